"""Run metrics: wandb (online/offline/disabled), a JSONL file, and a console progress line.

Metric names follow slime's (`rollout/raw_reward`, `train/pg_loss`, `perf/rollout_time`,
...) so dashboards carry over. The wandb run id is kept in the run directory, so a resumed
run continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from config import HomegymConfig, to_dict

# Keys whose values must never reach logs, wandb or checkpoints.
SECRET_MARKERS = ("api_key", "apikey", "token", "secret", "password")


def redact(obj: Any) -> Any:
    """A copy of a nested config dict with secret-looking values replaced."""
    if isinstance(obj, dict):
        return {k: "***" if any(m in str(k).lower() for m in SECRET_MARKERS) and v else redact(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Record the wall time of the block as metrics[key] (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = time.perf_counter() - start


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def mismatch_summary(m: dict[str, float]) -> str:
    """The train/rollout mismatch of a step in a few words: mean and max |log p_train -
    log p_rollout|, k3 KL, what the correction cut and how stale the batch was."""
    if "mismatch/logprob_abs_diff" not in m:
        return ""
    text = f"gap {m['mismatch/logprob_abs_diff']:.4f}"
    if "mismatch/logprob_abs_diff_max" in m:
        text += f" max {m['mismatch/logprob_abs_diff_max']:.3f}"
    if "mismatch/k3_kl" in m:
        text += f" k3 {m['mismatch/k3_kl']:.1e}"
    cut = m.get("mismatch/token_masked_frac", 0.0) + m.get("mismatch/token_clipped_frac", 0.0)
    if cut > 0:
        text += f" cut {cut:.1%}"
    if m.get("mismatch/staleness_max", 0.0) > 0:
        text += f" stale {m['mismatch/staleness_mean']:.2f}"
    return text


class MetricsLogger:
    def __init__(self, config: HomegymConfig, run_dir: Path, *, total_steps: int) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.console = config.logging.console
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._step_times: list[float] = []
        self._wandb = None
        if config.logging.wandb_mode != "disabled":
            self._wandb = self._init_wandb(config)

    def _init_wandb(self, config: HomegymConfig):
        import wandb

        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        name = self.run_dir.name
        return wandb.init(
            project=config.logging.wandb_project, group=config.logging.wandb_group,
            name=name, tags=list(config.logging.wandb_tags), id=run_id, resume="allow",
            mode=config.logging.wandb_mode, dir=str(self.run_dir),
            config=redact(to_dict(config)),
            # x_disable_meta: wandb would otherwise record sys.argv, secrets in overrides too.
            settings=wandb.Settings(silent=True, x_disable_meta=True))

    @property
    def wandb_run_id(self) -> str | None:
        return self._wandb.id if self._wandb is not None else None

    def log(self, step: int, metrics: dict[str, float], *, progress: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "perf/step_time" in clean:
            self._step_times.append(clean["perf/step_time"])
        if self.console and progress:
            print(self.progress_line(step, clean), file=sys.stdout, flush=True)

    def progress_line(self, step: int, m: dict[str, float]) -> str:
        # The ETA uses RL steps only (warm-up and evaluation are not steps).
        recent = self._step_times[-10:]
        per_step = sum(recent) / len(recent) if recent else 0.0
        eta = per_step * (self.total_steps - step)
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in (
            ("rollout/raw_reward", "reward", "{:+.3f}"),
            ("rollout/success_rate", "success", "{:.0%}"),
            ("train/pg_loss", "loss", "{:+.4f}"),
            ("train/grad_norm", "gnorm", "{:.3f}"),
            ("perf/rollout_time", "rollout", "{:.2f}s"),
            ("perf/train_time", "train", "{:.2f}s"),
            ("perf/weight_sync_time", "sync", "{:.2f}s"),
        ):
            if key in m:
                parts.append(f"{label} {fmt.format(m[key])}")
        if (gap := mismatch_summary(m)):
            parts.append(gap)
        parts.append(f"{per_step:.2f}s/step ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        if self._wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            self._wandb.log({name: wandb.Table(columns=columns,
                                               data=[[r.get(c) for c in columns] for r in rows])})

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
