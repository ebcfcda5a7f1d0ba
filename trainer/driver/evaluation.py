"""Evaluations during a run: one pass of the rollout manager over the eval split (and the
training prompts with eval.train_split), its rows in eval/<name>.jsonl and one line on the
console; at the end, the table of every evaluation (eval_table.md, eval.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray

from trainer.driver.metrics import write_json
from trainer.driver.report import EVAL_COLUMNS, format_eval_table, terminal_eval_table


def run_evaluation(manager: Any, *, train_split: bool) -> tuple[dict[str, float], list[dict]]:
    """(metrics, per-sample rows) of the policy the engines serve now."""
    result = ray.get(manager.evaluate.remote("eval"))
    metrics, rows = result["metrics"], result["rows"]
    if train_split:
        # The same measurement on the training prompts: what RL optimised, next to the
        # held-out split that shows whether it generalises.
        train = ray.get(manager.evaluate.remote("train"))
        metrics.update({f"train_{k}": v for k, v in train["metrics"].items()})
        rows += [{**row, "split": "train"} for row in train["rows"]]
    return metrics, rows


def write_rows(run_dir: Path, name: str, rows: list[dict]) -> None:
    eval_dir = run_dir / "eval"
    eval_dir.mkdir(exist_ok=True)
    with open(eval_dir / f"{name}.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def print_line(name: str, metrics: dict[str, float]) -> None:
    line = " | ".join(f"{title} {fmt.format(metrics[f'eval/{key}'])}"
                      for key, title, fmt in EVAL_COLUMNS if f"eval/{key}" in metrics)
    if "train_eval/success_rate" in metrics:
        line += f" | train-split success {metrics['train_eval/success_rate']:.1%}"
    print(f"eval [{name}] sampled: {line}", flush=True)


def write_eval_table(run_dir: Path, evals: dict[str, dict[str, float]]) -> str:
    """eval_table.md and eval.json of every evaluation, and the table on the console."""
    table = format_eval_table(evals)
    (run_dir / "eval_table.md").write_text(table + "\n")
    write_json(run_dir / "eval.json", evals)
    print(f"\n{terminal_eval_table(evals)}\nevery column: {run_dir / 'eval_table.md'}"
          f"\ncurves: {run_dir / 'curves.png'}", flush=True)
    return table


def summarize_gain(evals: dict[str, dict[str, float]], before: str = "base",
                   after: str = "trained") -> dict[str, Any]:
    """Success-rate change of the RL stage (percentage points), sampled and greedy."""
    out = {}
    for prefix in ("eval", "eval_greedy"):
        key = f"{prefix}/success_rate"
        if key in evals.get(before, {}) and key in evals.get(after, {}):
            out[prefix] = 100 * (evals[after][key] - evals[before][key])
    return out
