"""Colocated-synchronous vs disaggregated-asynchronous RL on the same work.

    python scripts/bench_async.py [--steps 12] [--batch 8] [--samples 8] [--warmup 100]

Runs `python -m trainer.main` twice, same model (tiny-qwen3), task (the guessing game),
steps, batch and seed: once colocated (engines and training ranks take turns), once
disaggregated with `algo.max_staleness=1` (generation of step s+1 overlaps training of
step s). Both layouts use ONE engine process and ONE training rank, one torch thread
each, so they use the same processes and differ only in scheduling. Prints the median
wall time per step (first step excluded) of each, the ratio, and where the time went.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(name: str, out: Path, args, *extra: str) -> dict:
    overrides = [
        f"train.num_steps={args.steps}", f"warmup.steps={args.warmup}",
        f"rollout.rollout_batch_size={args.batch}", f"rollout.n_samples_per_prompt={args.samples}",
        "rollout.num_engines=1", "train.ranks_per_node=1", "eval.before_and_after=false",
        "logging.wandb_mode=disabled", f"logging.output_dir={out}", f"logging.run_name={name}",
        *extra]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainer.main", *overrides], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r][1:]  # the first step warms caches

    def median(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else 0.0

    return {"layout": name, "wall_s": time.perf_counter() - start,
            "step_s": median("perf/step_time"), "rollout_s": median("perf/rollout_time"),
            "train_s": median("perf/train_time"), "sync_s": median("perf/weight_sync_time"),
            "trainer_wait_s": median("perf/trainer_wait_time"),
            "success": statistics.mean(r.get("rollout/success_rate", 0.0) for r in steps[-3:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--warmup", type=int, default=100, help="SFT warm-up steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="hg-bench-async-"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = [run("colocated_sync", out, args),
               run("disaggregated_async", out, args, "cluster.colocate=false",
                   "algo.max_staleness=1", "algo.rollout_correction=token_tis")]
    sync, asyn = results
    print(f"\nmodel tiny-qwen3, guessing game, {args.batch}x{args.samples} episodes/step, "
          f"{args.steps} steps, 1 engine + 1 rank, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| layout | s/step (median) | rollout s | train s | sync s | trainer wait s | success (last 3) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layout']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['train_s']:.2f} | "
              f"{r['sync_s']:.2f} | {r['trainer_wait_s']:.2f} | {r['success']:.0%} |")
    print(f"\nasync / sync step time: {asyn['step_s'] / sync['step_s']:.2f}x")
    (out / "bench_async.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'bench_async.json'}")


if __name__ == "__main__":
    main()
