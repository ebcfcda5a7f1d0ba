"""The driver: warm-up, evaluation and the RL loop.

Colocated (engines and training ranks share devices and take turns), per step:

    batch = rollout(step)                  # engines generate, environments score
    engines.release_memory(); train(batch); engines.resume_memory()
    push weights (version = step)          # engines generate from them at step + 1

The run directory holds the resolved config, metrics.jsonl, wandb files, checkpoints and
the base-vs-trained evaluation table.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf

from trainer.checkpoint import CheckpointManager, export_hf, preflight_output_dir
from trainer.config import HomegymConfig, to_dict
from trainer.metrics import MetricsLogger, redact, timed, write_json
from trainer.models import resolve_model_path
from trainer.runtime import Runtime
from trainer.weights import WeightSync

log = logging.getLogger("homegym")

EVAL_COLUMNS = (  # (metric suffix, column title, format)
    ("success_rate", "success", "{:.1%}"),
    ("raw_reward", "mean reward", "{:+.3f}"),
    ("mean_turns", "mean turns", "{:.2f}"),
    ("format_error_rate", "format errors", "{:.1%}"),
)


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    final_metrics: dict[str, float] = field(default_factory=dict)

    def checkpoints(self) -> list[Path]:
        return CheckpointManager(self.run_dir).all_complete()


def make_run_dir(config: HomegymConfig) -> Path:
    name = config.logging.run_name or (
        f"{config.recipe_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return Path(config.logging.output_dir).resolve() / name


def estimate_checkpoint_bytes(config: HomegymConfig) -> int:
    """Rough size of one checkpoint (weights + Adam moments + HF export), for the preflight."""
    path = Path(resolve_model_path(config.model.path, config.model.cache_dir))
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or 1
    return 5 * weights


def train(config: HomegymConfig) -> RunResult:
    run_dir = make_run_dir(config)
    preflight_output_dir(run_dir, min_free_bytes=estimate_checkpoint_bytes(config))
    OmegaConf.save(OmegaConf.create(redact(to_dict(config))), run_dir / "config.yaml")
    print(f"homegym: run {run_dir.name} -> {run_dir}  "
          f"(resume later with logging.run_name={run_dir.name})", flush=True)
    with Runtime(config, run_dir) as runtime:
        return Driver(config, run_dir, runtime).run()


class Driver:
    def __init__(self, config: HomegymConfig, run_dir: Path, runtime: Runtime) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rt = runtime
        self.ckpt = CheckpointManager(run_dir)
        self.sync = WeightSync(config, runtime.train_group, runtime.engines, mode="tensor")
        self.logger: MetricsLogger | None = None
        self.evals: dict[str, dict[str, float]] = {}

    # ------------------------------------------------------------------ the run
    def run(self) -> RunResult:
        cfg = self.config
        start_step = self.resume()
        self.logger = MetricsLogger(cfg, self.run_dir, total_steps=cfg.train.num_steps)
        metrics: dict[str, float] = {}
        try:
            if start_step == 0:
                if cfg.warmup.steps > 0:
                    self.evaluate("initial", step=0)
                    self.warmup()
                if cfg.eval.before_and_after:
                    self.evaluate("base", step=0)
            for step in range(start_step + 1, cfg.train.num_steps + 1):
                metrics = self.rl_step(step)
                self.logger.log(step, metrics)
                if cfg.train.save_interval and step % cfg.train.save_interval == 0:
                    self.save(step)
                if cfg.eval.interval and step % cfg.eval.interval == 0:
                    self.evaluate(f"step_{step}", step=step)
            last = cfg.train.num_steps
            if start_step < last and not (cfg.train.save_interval
                                          and last % cfg.train.save_interval == 0):
                self.save(last)
            if cfg.eval.before_and_after:
                self.evaluate("trained", step=last)
            self.write_eval_table()
        finally:
            self.logger.close()
        return RunResult(run_dir=self.run_dir, steps=cfg.train.num_steps, evals=self.evals,
                         final_metrics=metrics)

    def rl_step(self, step: int) -> dict[str, float]:
        rt, metrics = self.rt, {}
        with timed(metrics, "perf/step_time"):
            with timed(metrics, "perf/rollout_time"):
                batch = ray.get(rt.manager.generate.remote(step))
            if len(batch) == 0:
                # Every group was filtered out or failed: nothing to learn from this step.
                log.warning("step %d: empty rollout batch, skipping the update", step)
                return {**batch.metrics, "train/skipped": 1.0}
            rt.engines.release_memory()
            rt.train_group.onload()
            with timed(metrics, "perf/train_time"):
                metrics.update(rt.train_group.train_step(batch))
            rt.train_group.offload()
            rt.engines.resume_memory()
            metrics.update(self.sync.push(version=step))
        metrics.update(batch.metrics)
        self._record_data_order(step, batch)
        return metrics

    def _record_data_order(self, step: int, batch) -> None:
        """One line per step: the group labels trained on, in order (resume checks use it)."""
        groups: dict[int, Any] = {}
        for gid, label in zip(batch.group_ids, batch.labels):
            groups.setdefault(gid, label)
        with open(self.run_dir / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "labels": list(groups.values())}, default=str) + "\n")

    # ------------------------------------------------------------------ warm-up
    def warmup(self) -> None:
        """Supervised warm-up on the environment's scripted transcripts (SFT)."""
        from transformers import AutoTokenizer

        from rollout.demos import make_demos
        from rollout.sample import RolloutBatch

        cfg = self.config.warmup
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(self.config.model.path, self.config.model.cache_dir))
        start = time.perf_counter()
        demos = make_demos(self.config, tokenizer, cfg.steps * cfg.batch_size, seed=cfg.seed)
        for s in demos:
            s.reward = 0.0  # SFT ignores rewards; the batch format requires one
        print(f"warm-up: {len(demos)} scripted transcripts in "
              f"{time.perf_counter() - start:.1f}s; {cfg.steps} SFT steps", flush=True)
        for i in range(cfg.steps):
            chunk = demos[i * cfg.batch_size:(i + 1) * cfg.batch_size]
            m = self.rt.train_group.sft_step(RolloutBatch.from_samples(chunk))
            if (i + 1) % max(1, cfg.steps // 10) == 0 or i + 1 == cfg.steps:
                print(f"warm-up step {i + 1}/{cfg.steps} | nll {m.get('train/sft_loss', float('nan')):.4f}"
                      f" | {time.perf_counter() - start:.1f}s", flush=True)
        self.sync.push(version=0)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, name: str, *, step: int) -> dict[str, float]:
        result = ray.get(self.rt.manager.evaluate.remote("eval"))
        metrics = result["metrics"]
        self.evals[name] = metrics
        eval_dir = self.run_dir / "eval"
        eval_dir.mkdir(exist_ok=True)
        with open(eval_dir / f"{name}.jsonl", "w") as f:
            for row in result["rows"]:
                f.write(json.dumps(row, default=str) + "\n")
        if self.logger is not None:
            self.logger.log(step, {f"{name}/{k}": v for k, v in metrics.items()}, progress=False)
        line = " | ".join(f"{title} {fmt.format(metrics[f'eval/{key}'])}"
                          for key, title, fmt in EVAL_COLUMNS if f"eval/{key}" in metrics)
        print(f"eval [{name}] sampled: {line}", flush=True)
        return metrics

    def write_eval_table(self) -> str:
        table = format_eval_table(self.evals)
        (self.run_dir / "eval_table.md").write_text(table + "\n")
        write_json(self.run_dir / "eval.json", self.evals)
        print("\n" + table, flush=True)
        return table

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        rt = self.rt
        state = ray.get(rt.manager.state_dict.remote())
        model_dir = resolve_model_path(self.config.model.path, self.config.model.cache_dir)
        path = self.ckpt.save(
            step, save_train=lambda d: rt.train_group.save(str(d)),
            export_hf=lambda d: export_hf(
                rt.train_group.named_weight_buckets(self.sync.bucket_bytes), model_dir, d),
            rollout_state=state, meta={"policy_version": step, "evals": self.evals})
        print(f"checkpoint: {path}", flush=True)
        return path

    def resume(self) -> int:
        path = self.ckpt.resolve_resume(self.config.train.resume)
        if path is None:
            return 0
        resumed = self.ckpt.load(path, load_train=lambda d: self.rt.train_group.load(str(d)))
        ray.get(self.rt.manager.load_state_dict.remote(resumed.rollout_state))
        self.evals = dict(resumed.meta.get("evals", {}))
        self.sync.push(version=resumed.step)
        print(f"resumed from {path} at step {resumed.step}", flush=True)
        return resumed.step


def format_eval_table(evals: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per evaluation, sampled and greedy columns."""
    header = ["model"]
    for prefix, label in (("eval", "sampled"), ("eval_greedy", "greedy")):
        header += [f"{title} ({label})" for _, title, _ in EVAL_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, m in evals.items():
        cells = [name]
        for prefix in ("eval", "eval_greedy"):
            for key, _, fmt in EVAL_COLUMNS:
                value = m.get(f"{prefix}/{key}")
                cells.append(fmt.format(value) if value is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize_gain(evals: dict[str, dict[str, float]], before: str = "base",
                   after: str = "trained") -> dict[str, Any]:
    """Success-rate change of the RL stage (percentage points), sampled and greedy."""
    out = {}
    for prefix in ("eval", "eval_greedy"):
        key = f"{prefix}/success_rate"
        if key in evals.get(before, {}) and key in evals.get(after, {}):
            out[prefix] = 100 * (evals[after][key] - evals[before][key])
    return out
