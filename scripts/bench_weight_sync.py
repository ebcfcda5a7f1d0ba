"""Weight-sync time of the SmolLM2 CPU recipe's layout: one push = one RL step's sync.

    python scripts/bench_weight_sync.py [--pushes 6] [OVERRIDES ...]

The layout `+recipe=smollm2_cpu` runs (2 hf engines behind the router, 2 FSDP training
ranks, colocated, the tensor route, bf16 engines; OVERRIDES are Hydra overrides on top of
it, e.g. `model.dtype=float32`), built from the same pieces `trainer.main` builds. Each
push is `WeightSync.push` of the trainer's weights, verified as in every run. Prints the
median and fastest push, the bytes per push, the rank-side phases (gather, cast, stage
and send) and the CPU, load average and torch version, so two runs compare side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _start_profiles(out_dir: str, group, engines) -> list:
    import ray

    py_spy = Path(sys.executable).with_name("py-spy")
    os.makedirs(out_dir, exist_ok=True)
    pids = {f"rank{i}": ray.get(a.__ray_call__.remote(lambda self: os.getpid()))
            for i, a in enumerate(group.actors)}
    pids.update({f"engine{i}": ray.get(e.pid.remote()) for i, e in enumerate(engines.engines)})
    spies = [subprocess.Popen([str(py_spy), "record", "--native", "-r", "200", "-p", str(pid),
                               "-o", os.path.join(out_dir, f"{name}.svg")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()]
    return spies  # attached by the second push; the first is left out of the figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy each training rank and engine server during the pushes "
                             "(flame graphs, .svg, in DIR)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import ray
    import torch

    from config import compose_config
    from trainer.driver import components
    from trainer.driver.runtime import connect_ray

    cfg = compose_config(["+recipe=smollm2_cpu", *args.overrides])
    connect_ray(cfg)
    placement = components.placement(cfg)
    engines = components.engine_group(cfg, placement)
    group = None
    pushes = []
    try:
        group = components.train_group(cfg, placement)
        sync = components.weight_sync(cfg, group, engines)
        spies = _start_profiles(args.profile, group, engines) if args.profile else []
        for version in range(1, args.pushes + 1):
            start = time.perf_counter()
            metrics = sync.push(version)
            metrics["wall"] = time.perf_counter() - start
            pushes.append(metrics)
            print(f"push {version}: {metrics['wall']:.3f} s", flush=True)
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its flame graph on SIGINT
            spy.wait(timeout=60)
    finally:
        if group is not None:
            group.shutdown()
        engines.shutdown()
        placement.shutdown()
        ray.shutdown()

    timed = pushes[1:] or pushes  # the first push also creates the staging buffers
    walls = [m["wall"] for m in timed]
    print(f"\n{_cpu_name()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, torch {torch.__version__}")
    print(f"{cfg.derived.num_engines} {cfg.rollout.engine} engines, {cfg.train.world_size} ranks, "
          f"{sync.mode} route, engine dtype {cfg.rollout.dtype or cfg.model.dtype}, "
          f"{pushes[-1]['perf/weight_sync_bytes'] / 1e6:.0f} MB per engine per push, "
          f"{pushes[-1]['perf/weight_sync_buckets']:.0f} buckets, "
          f"{pushes[-1]['perf/weight_sync_checked_tensors']:.0f} tensors checked")
    print(f"push (s), pushes 2..{len(pushes)}: median {statistics.median(walls):.3f}, "
          f"fastest {min(walls):.3f}")
    phases = sorted(k for k in timed[0] if k.startswith("perf/weight_sync_") and k.endswith("_time")
              and k != "perf/weight_sync_time")
    for key in phases:
        print(f"  {key}: median {statistics.median(m[key] for m in timed):.3f}")


if __name__ == "__main__":
    main()
