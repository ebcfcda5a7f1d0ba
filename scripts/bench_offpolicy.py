"""Rollout corrections side by side, in the train/rollout mismatch regimes a CPU box has.

    python scripts/bench_offpolicy.py [--seeds 3] [--steps 8] [--regimes bf16,async,noise]
                                      [--corrections none,token_tis,...] [--noise 0.05]

The default task (the guessing game on tiny-qwen3) is warmed up once (400 SFT steps, the
default recipe's; cached under $HOMEGYM_CACHE/bench_offpolicy), then every correction
trains ``--steps`` GRPO steps from that checkpoint in each regime, once per seed:

- ``bf16``: homegym's CPU engine serves bfloat16, the trainer computes in float32 (real
  SGLang-on-CPU needs AVX-512 + AMX, which an AVX2 box lacks);
- ``async``: disaggregated, generation up to ``algo.max_staleness=2`` policy versions
  ahead of training (fp32 both sides: the mismatch is staleness alone);
- ``noise``: fp32 both sides, the engine's weights multiplied by 1 + noise * N(0, 1)
  (``rollout.weight_noise``), a known, steady mismatch.

A regime's runs share one Ray instance, engine and training rank: before each run the
rank reloads the checkpoint taken when the regime started (weights and optimizer), swaps
its loss settings (``TrainGroup.set_algo``), a new rollout manager takes the run's data
seed, and the engine gets the weights again. Each run reports the mismatch metrics
averaged over its steps, its rollout reward per step, and held-out success (the even
targets, 8 seeded samples each: every run is scored on the same draws) after its last
step. One engine and one training rank, one torch thread each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CORRECTIONS = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mask", "icepop")
REGIMES = {
    "bf16": ["rollout.dtype=bfloat16"],
    "async": ["cluster.colocate=false", "algo.max_staleness=2",
              "algo.allow_uncorrected_staleness=true"],  # none is the baseline
    "noise": [],  # + rollout.weight_noise=<--noise>
}
# The table's mismatch columns: metric, header, format.
COLUMNS = (("mismatch/logprob_abs_diff", "mean abs dlogp", "{:.4f}"),
           ("mismatch/logprob_abs_diff_max", "max abs dlogp", "{:.3f}"),
           ("mismatch/k3_kl", "k3 KL", "{:.1e}"),
           ("mismatch/token_ratio_p1", "token ratio p1", "{:.3f}"),
           ("mismatch/token_ratio_p99", "p99", "{:.3f}"),
           ("mismatch/seq_ratio_p1", "seq ratio p1", "{:.3f}"),
           ("mismatch/seq_ratio_p99", "p99", "{:.3f}"),
           ("cut_tokens", "tokens cut", "{:.1%}"),
           ("mismatch/seq_masked_frac", "seqs masked", "{:.1%}"),
           ("mismatch/staleness_mean", "staleness", "{:.2f}"))


def common_overrides(args, model_path: str) -> list[str]:
    return [f"model.path={model_path}", "rollout.num_engines=1", "train.ranks_per_node=1",
            f"rollout.rollout_batch_size={args.prompts}",
            f"rollout.n_samples_per_prompt={args.samples}", f"train.num_steps={args.steps}",
            "warmup.steps=0", "eval.before_and_after=false", "eval.greedy=false",
            "eval.train_split=false", f"eval.n_samples_per_prompt={args.eval_samples}",
            "logging.wandb_mode=disabled", "logging.console=false", "train.hang_timeout_s=null"]


def warm_checkpoint(args, out: Path) -> str:
    """The default recipe's warm-up, once: its HF export, cached by its settings."""
    from config import compose_config

    base = compose_config(["rollout.num_engines=1", "train.ranks_per_node=1",
                           "logging.wandb_mode=disabled", "train.hang_timeout_s=null"])
    w = base.warmup
    key = hashlib.sha256(json.dumps([base.model.path, w.steps, w.lr, w.batch_size, w.seed,
                                     list(w.splits), base.env.kwargs], default=str)
                         .encode()).hexdigest()[:12]
    cache = Path(os.environ.get("HOMEGYM_CACHE", Path.home() / ".cache" / "homegym"))
    hf = cache / "bench_offpolicy" / f"warm-{key}" / "hf"
    if (hf / "config.json").exists():
        print(f"warm-up: cached {hf}", flush=True)
        return str(hf)
    from rollout.models import resolve_model_path
    from trainer.driver.runtime import Runtime
    from trainer.driver.warmup import warm_up

    start = time.perf_counter()
    run_dir = out / "warmup"
    run_dir.mkdir(parents=True, exist_ok=True)
    with Runtime(base, run_dir) as rt:
        warm_up(base, rt.train_group)
        tmp = hf.with_name("hf.tmp")
        rt.train_group.export_hf(str(tmp), resolve_model_path(base.model.path, base.model.cache_dir),
                                 rt.weights.bucket_bytes)
        os.replace(tmp, hf)
    print(f"warm-up: {w.steps} SFT steps in {time.perf_counter() - start:.0f}s -> {hf}", flush=True)
    return str(hf)


def run_regime(name: str, overrides: list[str], args, out: Path, results: list[dict]) -> None:
    """Every (seed, correction) run of one regime on one runtime, appended to ``results``
    (and written to <out>/results.json after each)."""
    import ray

    from config import compose_config
    from rollout.manager import RolloutManager
    from trainer.driver import components
    from trainer.driver.loop import Driver
    from trainer.driver.runtime import Runtime

    def config_for(correction: str, seed: int):
        return compose_config([*overrides, f"algo.rollout_correction={correction}",
                               f"data.seed={seed}", f"train.seed={seed}"])

    first = config_for(args.corrections[0], args.seeds[0])
    regime_dir = out / name
    regime_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with Runtime(first, regime_dir) as rt:
        reset = str(regime_dir / "reset")
        rt.train_group.save(reset)  # the warmed weights and a fresh optimizer
        base = Driver(first, regime_dir, rt)
        base.push_weights(0)
        base_success = base.evaluate(f"{name}-base", step=0)["eval/success_rate"]
        print(f"[{name}] runtime up and base evaluated in {time.perf_counter() - start:.0f}s",
              flush=True)
        for seed in args.seeds:
            for correction in args.corrections:
                config = config_for(correction, seed)
                t0 = time.perf_counter()
                rt.train_group.load(reset)
                rt.train_group.set_algo(config.algo)
                ray.kill(rt.manager)
                rt.manager = RolloutManager.remote(router_url=rt.engines.router_url,
                                                   **components.manager_args(config))
                run_dir = regime_dir / f"{correction}-seed{seed}"
                run_dir.mkdir(exist_ok=True)
                driver = Driver(config, run_dir, rt)
                driver.push_weights(0)
                steps = driver.colocated_steps if config.cluster.colocate else driver.async_steps
                rows = [metrics for _, metrics in steps(0)]
                with open(run_dir / "metrics.jsonl", "w") as f:
                    for i, row in enumerate(rows, 1):
                        f.write(json.dumps({"step": i, **row}) + "\n")
                success = driver.evaluate(f"{name}-{correction}-seed{seed}",
                                          step=args.steps)["eval/success_rate"]
                result = {"regime": name, "correction": correction, "seed": seed,
                          "success": success, "base_success": base_success,
                          "wall_s": time.perf_counter() - t0,
                          "rollout_success_last": rows[-1].get("rollout/success_rate"),
                          "reward_curve": [r.get("rollout/raw_reward") for r in rows]}
                for key, _, _ in COLUMNS:
                    if key == "cut_tokens":
                        values = [r.get("mismatch/token_masked_frac", 0.0)
                                  + r.get("mismatch/token_clipped_frac", 0.0) for r in rows
                                  if "mismatch/logprob_abs_diff" in r]
                    else:
                        values = [r[key] for r in rows if key in r]
                    result[key] = statistics.mean(values) if values else None
                results.append(result)
                print(f"[{name}] {correction:9s} seed {seed}: held-out {success:.1%} "
                      f"(base {base_success:.1%}), gap {result['mismatch/logprob_abs_diff'] or 0:.4f}, "
                      f"{result['wall_s']:.0f}s", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))


def table(results: list[dict], args) -> str:
    lines = []
    header = ["regime", "correction", *(h for _, h, _ in COLUMNS), "reward per step",
              "held-out success (mean +- sd)",
              "per seed", "vs none"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    by_key: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        by_key.setdefault((r["regime"], r["correction"]), []).append(r)
    for (regime, correction), runs in by_key.items():
        runs.sort(key=lambda r: r["seed"])
        cells = [regime, correction]
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in runs if r.get(key) is not None]
            cells.append(fmt.format(statistics.mean(values)) if values else "-")
        # The reward curve: rollout reward per RL step, mean over seeds.
        curves = [r["reward_curve"] for r in runs]
        cells.append(" ".join(f"{statistics.mean(c[i] for c in curves):.2f}"
                              for i in range(min(map(len, curves)))))
        succ = [r["success"] for r in runs]
        sd = statistics.stdev(succ) if len(succ) > 1 else 0.0
        cells.append(f"{statistics.mean(succ):.1%} +- {sd:.1%}")
        cells.append(" ".join(f"{s:.0%}" for s in succ))
        ref = {r["seed"]: r["success"] for r in by_key.get((regime, "none"), [])}
        diffs = [r["success"] - ref[r["seed"]] for r in runs if r["seed"] in ref]
        if correction != "none" and len(diffs) > 1:
            se = statistics.stdev(diffs) / len(diffs) ** 0.5
            cells.append(f"{statistics.mean(diffs) * 100:+.1f} +- {se * 100:.1f} pts")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    bases = {r["regime"]: r["base_success"] for r in results}
    lines.append("")
    lines.append("base (warmed-up, before RL) held-out success per regime: "
                 + ", ".join(f"{k} {v:.1%}" for k, v in bases.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per correction and regime")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="games per prompt")
    parser.add_argument("--eval-samples", type=int, default=8, help="seeded samples per eval target")
    parser.add_argument("--noise", type=float, default=0.05, help="rollout.weight_noise of 'noise'")
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--corrections", default=",".join(CORRECTIONS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.seeds = list(range(1, args.seeds + 1))
    args.corrections = args.corrections.split(",")
    out = args.out or Path(tempfile.mkdtemp(prefix="hg-bench-offpolicy-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start, load_before = time.perf_counter(), os.getloadavg()
    model = warm_checkpoint(args, out)
    results: list[dict] = []
    for name in args.regimes.split(","):
        extra = [f"rollout.weight_noise={args.noise}"] if name == "noise" else REGIMES[name]
        run_regime(name, [*common_overrides(args, model), *extra], args, out, results)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")
    print(f"\ntiny-qwen3, the guessing game, {args.prompts} prompts x {args.samples} games per "
          f"step, {args.steps} GRPO steps per run, seeds {args.seeds}, held-out eval "
          f"{args.eval_samples} seeded samples x 10 targets; 1 engine + 1 rank; noise "
          f"{args.noise}; {os.cpu_count()} CPUs ({cpu}); load {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {(time.perf_counter() - start) / 60:.1f} min\n")
    print(table(results, args))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
