"""The FSDP rank's RL train step in one process (one rank over gloo, one thread), two
implementations of one part side by side, interleaved.

    .venv/bin/python scripts/bench_train_step.py [--compare optimizer|attention|vocab]
        [--steps 12] [--groups 4] [--group-size 8]
    .venv/bin/python scripts/bench_train_step.py --profile     # torch profiler, top ops

The batch is shaped like ``bench_vs_trl.py``'s multi-turn game (4 prompts x 8 samples,
~75-token prompts, 40-90 response tokens, groups opening alike), on tiny-qwen3. Each
variant is an ``FSDPBackend`` of its own; steps alternate between them, and the CPU time
of each ``train_step`` is read with ``time.process_time`` (the first two are dropped).
The comparisons, the second variant of each being what the backend uses:

- ``optimizer``: torch's AdamW as torch picks it on CPU (its per-tensor loop) against the
  fused one; also times the optimizer step alone;
- ``attention``: the shared-prefix attention with every row re-padded to the longest
  suffix against rows in buckets of similar length (``packed_attention.row_buckets``);
- ``vocab``: the response tokens' log-probs and entropies from two passes over the
  vocabulary (``token_log_probs``, ``entropy_from_logits``) against one
  (``token_log_probs_and_entropy``).

Not a test: timings depend on the machine and on what else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _optimizer(impl: dict):
    def apply() -> None:
        from trainer.training.backends import fsdp

        fsdp._ADAMW_IMPL = impl  # read when a backend builds its optimizer
    return apply


def _vocab_passes(n: int):
    def apply() -> None:
        from trainer.training.algo import losses
        from trainer.training.backends import fsdp

        def two_passes(logits, targets, *, entropy_grad):
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                entropy = losses.entropy_from_logits(logits)
            return losses.token_log_probs(logits, targets), entropy
        # read by the backend's forward at every call
        fsdp.token_log_probs_and_entropy = (two_passes if n == 2
                                            else losses.token_log_probs_and_entropy)
    return apply


def _buckets(n: int):
    def apply() -> None:
        from trainer.training.backends import packed_attention

        packed_attention.MAX_BUCKETS = n  # read when a micro-batch's attention is planned
    return apply


# Per comparison, its variants: a setting applied before the backend is built and before
# each of its steps.
COMPARISONS = {
    "optimizer": {"default": _optimizer({}), "fused": _optimizer({"fused": True, "foreach": None})},
    "attention": {"one width": _buckets(1), "buckets": _buckets(4)},
    "vocab": {"two passes": _vocab_passes(2), "one pass": _vocab_passes(1)},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="optimizer")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--profile", action="store_true",
                   help="profile 3 steps of the backend as it is instead (torch profiler)")
    args = p.parse_args()

    from train_batches import make_batch, make_config

    from rollout.engines import free_port
    from trainer.driver.components import backend_args
    from trainer.training.backends import make_backend

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = make_config(train={"lr": 1e-4})
    batch = make_batch(num_groups=args.groups, group_size=args.group_size, prompt_len=(70, 80),
                       response_len=(40, 90), seed=3, common_start=10)
    tokens = sum(len(t) for t in batch.tokens)
    variants = COMPARISONS[args.compare]
    backends = {}
    for name in ([list(variants)[-1]] if args.profile else variants):
        variants[name]()
        backend = make_backend("fsdp")
        backend.init(rank=0, world_size=1, **backend_args(config))
        backends[name] = backend
    print(f"tiny-qwen3, {len(batch.tokens)} samples, {tokens} tokens, one rank, one thread; "
          f"CPU: {cpu_name()}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        (backend,) = backends.values()
        for _ in range(2):
            backend.train_step(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                backend.train_step(batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.steps):
        for name, backend in backends.items():
            variants[name]()
            t0 = time.process_time()
            backend.train_step(batch)
            times[name].append(time.process_time() - t0)
    med = {}
    for name, ts in times.items():
        ts = ts[2:]
        med[name] = statistics.median(ts)
        print(f"  {name:9s} train step CPU s: min {min(ts):.4f}  median {med[name]:.4f}")
    a, b = variants
    print(f"{b} / {a} (medians): {med[b] / med[a]:.3f}")
    if args.compare != "optimizer":
        return
    print("the optimizer step alone (wall ms, median of 30, after the runs above):")
    for name, backend in backends.items():
        params = [q for q in backend.model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.full_like(q, 1e-3)
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            backend.optimizer.step()
            ts.append(time.perf_counter() - t0)
        print(f"  {name:8s} {statistics.median(ts) * 1e3:.2f} ms over {len(params)} tensors")


def cpu_name() -> str:
    """Model name, family/model and vector extensions: what the figures depend on."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    flags = set(info.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return (f"{info.get('model name', '?')} family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')} ({isa}{', AMX' if 'amx_tile' in flags else ''}), "
            f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
