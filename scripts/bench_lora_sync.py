"""Weight-sync cost per step of a LoRA policy vs the full model: push bytes and time.

    python scripts/bench_lora_sync.py [--model smollm2-135m] [--rank 16] [--pushes 5]

Real pieces, one CPU engine (homegym's hf engine) behind the router and one FSDP training
rank, as `trainer.main` builds them; the push is `WeightSync.push` (the tensor route, as
in the colocated default), verified by version and read-back like every run's:
- full:    the full model trains; every push sends all its weights;
- merged:  train.lora.rank=R; every push sends W + s*B@A under the HF names (same bytes:
           the engine loads it like any update; the cost added is the merge);
- adapter: train.lora.rank=R; the adapter alone, gathered and written in peft format
           (adapter_model.safetensors + adapter_config.json), the files SGLang's
           `/load_lora_adapter` reads; the engine's load is not included;
- adapter-sglang (with --sglang-python): the adapter push of a run (trainer.weight_sync.adapter.
           AdapterSync: write, `/load_lora_adapter` into a real SGLang CPU engine started
           with --enable-lora, `/update_weight_version`, unload of older adapters).
Each training group takes one RL step on a synthetic batch first (so the adapters are
non-zero). Prints a markdown table; also the training rank's peak RSS per mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _peak_rss_mib(group) -> float:
    import ray

    def peak(actor_self):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    return ray.get(group.actors[0].__ray_call__.remote(peak))


def _adapter_to_sglang(args, lora_cfg, placement, batch) -> tuple:
    """The adapter-sglang row: AdapterSync into one real SGLang CPU engine serving LoRA."""
    import dataclasses

    from trainer.driver import components
    from trainer.weight_sync.adapter import AdapterSync

    cfg = dataclasses.replace(lora_cfg, rollout=dataclasses.replace(
        lora_cfg.rollout, engine="sglang", dtype="bfloat16", sglang_python=args.sglang_python))
    engines = components.engine_group(cfg, placement)
    group = components.train_group(cfg, placement)
    out = tempfile.mkdtemp(prefix="hg-adapter-push-")
    try:
        group.train_step(batch)
        sync = AdapterSync(cfg.train, group, engines, disk_dir=out, announce=lambda name: None)
        times, num_bytes = [], 0
        for version in range(1, args.pushes + 1):
            metrics = sync.push(version)
            times.append(metrics["perf/weight_sync_time"])
            num_bytes = metrics["perf/weight_sync_bytes"]
        trainable = sum(t.numel() for _, t in group.adapter_tensors())
        return ("adapter-sglang", num_bytes, statistics.median(times), min(times), trainable,
                _peak_rss_mib(group))
    finally:
        group.shutdown()
        engines.shutdown()
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--sglang-python", default="",
                        help="an SGLang venv's interpreter: add the adapter push to real SGLang")
    args = parser.parse_args()

    import ray
    import torch

    from train_batches import make_batch
    from trainer.training.backends.lora import save_adapter
    from config import build_config
    from rollout.models import resolve_model_path
    from trainer.driver import components
    from trainer.driver.runtime import connect_ray

    def config(rank: int):
        return build_config({
            "model": {"path": args.model}, "cluster": {"device": "cpu"},
            "rollout": {"num_engines": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 4},
            "train": {"ranks_per_node": 1, "lr": 1e-4,
                      "lora": {"rank": rank, "alpha": args.alpha}}})

    full_cfg, lora_cfg = config(0), config(args.rank)
    model_path = resolve_model_path(full_cfg.model.path, full_cfg.model.cache_dir)
    batch = make_batch(num_groups=2, group_size=4, seed=0, vocab=1000)
    connect_ray(full_cfg)
    placement = components.placement(full_cfg)
    engines = components.engine_group(full_cfg, placement)
    rows, version = [], 0
    try:
        for mode, cfg in (("full", full_cfg), ("merged", lora_cfg), ("adapter", lora_cfg)):
            group = components.train_group(cfg, placement)
            try:
                group.train_step(batch)
                times, num_bytes = [], 0
                if mode == "adapter":
                    for _ in range(args.pushes):
                        out = tempfile.mkdtemp(prefix="hg-adapter-")
                        start = time.perf_counter()
                        save_adapter(dict(group.adapter_tensors()), cfg.train.lora, model_path, out)
                        times.append(time.perf_counter() - start)
                        num_bytes = sum(f.stat().st_size for f in Path(out).iterdir())
                        shutil.rmtree(out)
                else:
                    sync = components.weight_sync(cfg, group, engines, mode="tensor")
                    for _ in range(args.pushes):
                        version += 1
                        metrics = sync.push(version)
                        times.append(metrics["perf/weight_sync_time"])
                        num_bytes = metrics["perf/weight_sync_bytes"]
                trainable = sum(t.numel() for _, t in group.adapter_tensors()) if mode != "full" \
                    else sum(t.numel() for b in group.named_weight_buckets(1 << 30) for _, t in b)
                rows.append((mode, num_bytes, statistics.median(times), min(times), trainable,
                             _peak_rss_mib(group)))
            finally:
                group.shutdown()
        if args.sglang_python:
            engines.shutdown()  # its placement bundle hosts the SGLang engine next
            rows.append(_adapter_to_sglang(args, lora_cfg, placement, batch))
    finally:
        engines.shutdown()
        placement.shutdown()
        ray.shutdown()

    load = os.getloadavg()[0]
    print(f"\nmodel {args.model}, LoRA rank {args.rank} (alpha {args.alpha}, all 7 projections), "
          f"engine dtype float32, {args.pushes} pushes each, load average {load:.1f} "
          f"on {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print("| mode | bytes per push | median push (s) | fastest (s) | trained params | rank peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, num_bytes, med, best, trainable, rss in rows:
        print(f"| {mode} | {num_bytes / 2**20:.1f} MiB | {med:.3f} | {best:.3f} | "
              f"{trainable / 1e6:.2f} M | {rss:.0f} |")


if __name__ == "__main__":
    main()
