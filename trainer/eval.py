"""Evaluate models or checkpoints on an environment's eval split, side by side.

    python -m trainer.eval +recipe=number_guess_cpu checkpoint=outputs/<run>/checkpoints/latest
    python -m trainer.eval checkpoint=outputs/<run> compare=base        # base model vs trained
    python -m trainer.eval checkpoint=A compare=B out=table.md rollout.max_concurrency=64

Extra keys: ``checkpoint`` (a checkpoint dir, its ``hf/`` dir, a run dir = its latest
checkpoint, or ``base`` = ``model.path``; default ``base``), ``compare`` (a second one, same
forms), ``out`` (where to write the markdown table; default
``<logging.output_dir>/eval/<timestamp>/table.md``, with ``eval.json`` and per-sample
``<name>.jsonl`` beside it). Everything else is a Hydra override of the run config.

Each model is served by the same engines + router as in training, and the rollout
manager's ``evaluate("eval")`` plays every eval prompt ``eval.n_samples_per_prompt`` times
sampled (``eval.temperature``) and once greedy (``eval.greedy``), up to
``rollout.max_concurrency`` episodes at a time. The table has success rate, mean reward,
mean turns and format-error rate for both.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

BASE = "base"


def _label(spec: str, resolved: Optional[str] = None) -> str:
    """``base``, or ``<run>/<step>`` for a checkpoint's hf/ directory, else the path."""
    if spec == BASE:
        return BASE
    p = Path(resolved or spec)
    if p.name == "hf":
        p = p.parent
    if p.parent.name == "checkpoints":
        return f"{p.parent.parent.name}/{p.name}"
    return str(spec)


def evaluate_models(specs: Sequence[str], overrides: Sequence[str] = (),
                    values: Optional[dict] = None, *, quiet: bool = False
                    ) -> dict[str, dict[str, Any]]:
    """``{label: {"metrics": ..., "rows": ..., "model_path": ...}}`` for each spec ("base"
    or a checkpoint path), evaluated one after the other on the current Ray cluster."""
    import ray

    from config import compose_config
    from rollout.manager import RolloutManager
    from trainer.driver import components
    from trainer.driver.checkpoint import resolve_checkpoint
    from trainer.driver.runtime import connect_ray

    results: dict[str, dict[str, Any]] = {}
    started_ray = False
    try:
        for spec in specs:
            vals = json.loads(json.dumps(values or {}))
            resolved = None
            if spec != BASE:
                resolved = vals.setdefault("model", {})["path"] = resolve_checkpoint(spec)
            config = compose_config(overrides, vals)
            started_ray = connect_ray(config) or started_ray
            label = _label(spec, resolved)
            if label in results:
                label = f"{label} ({len(results) + 1})"
            if not quiet:
                print(f"homegym eval: {label} ({config.model.path}) with "
                      f"{config.derived.num_engines} {config.rollout.engine} engine(s)", flush=True)
            engines = components.engine_group(config)
            manager = None
            try:
                manager = RolloutManager.remote(router_url=engines.router_url,
                                                **components.manager_args(config))
                out = ray.get(manager.evaluate.remote("eval"))
            finally:
                if manager is not None:
                    ray.kill(manager)
                engines.shutdown()
            results[label] = {"metrics": out["metrics"], "rows": out["rows"],
                              "model_path": config.model.path}
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()
    return results


def write_results(results: dict[str, dict[str, Any]], out: Path) -> str:
    from trainer.driver.report import format_eval_table

    out.parent.mkdir(parents=True, exist_ok=True)
    table = format_eval_table({k: v["metrics"] for k, v in results.items()})
    out.write_text(table + "\n")
    (out.parent / "eval.json").write_text(json.dumps(
        {k: {"model_path": v["model_path"], "metrics": v["metrics"]} for k, v in results.items()},
        indent=2, default=str) + "\n")
    for i, (label, v) in enumerate(results.items()):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        with open(out.parent / f"{i}_{safe}.jsonl", "w") as f:
            for row in v["rows"]:
                f.write(json.dumps(row, default=str) + "\n")
    return table


def main(argv: Optional[Sequence[str]] = None) -> int:
    from trainer.driver.checkpoint import resolve_checkpoint
    from config import compose_config, split_args
    from config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    own, overrides = split_args(argv, ("checkpoint", "compare", "out"))
    specs = [own.get("checkpoint", BASE)] + ([own["compare"]] if "compare" in own else [])
    try:
        base_config = compose_config(overrides)
        for s in specs:
            if s != BASE:
                resolve_checkpoint(s)
    except (ConfigError, FileNotFoundError) as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        return 2
    out = Path(own["out"]) if "out" in own else (
        Path(base_config.logging.output_dir) / "eval" / f"{datetime.now():%Y%m%d-%H%M%S}" / "table.md")
    from trainer.main import user_error

    try:
        results = evaluate_models(specs, overrides)
    except Exception as err:  # a config error inside an actor: one line, not Ray's traceback
        reported = user_error(err)
        if reported is None:
            raise
        print(f"homegym: {reported}", file=sys.stderr)
        return 2
    write_results(results, out)
    from trainer.driver.report import terminal_eval_table

    table = terminal_eval_table({k: v["metrics"] for k, v in results.items()})
    print(f"\n{table}\n\nevery column: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
