"""Micro-benchmark the CPU engine's kernels against the torch ops they replace, one thread.

    .venv/bin/python scripts/bench_engine_kernels.py

- matmuls at SmolLM2-135M's shapes (batch-64 decode, prefill chunks, the LM head):
  ``F.linear`` (MKL sgemm) vs ``PackedLinears`` (oneDNN on a weight packed once), and the
  LM head in vocabulary slices (the engine's path without oneDNN);
- RMSNorm at decode shapes: ``F.rms_norm`` vs the C kernel;
- decode attention over a batch of 64 rows of mixed lengths (10-160 + 20 cached tokens
  in a 192-column window): the torch path (folded GQA) vs the C kernel, with tiny-qwen3's
  and SmolLM2's head layouts;
- prefill attention of fresh prompts packed end to end (the burst's 64 prompts of 8-160
  tokens, and a few long ones): one causal SDPA call per prompt vs the C kernel, at
  tiny-qwen3's, SmolLM2's and Qwen3-0.6B's head layouts.
Prints times, GFLOP/s where meaningful, and the speed-up. Not a test: timings depend on
the machine and on what else runs on it.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout.engines.hf import fast_kernels, native, packed_linear  # noqa: E402

torch.set_num_threads(1)


def best_time(fn, min_s: float = 0.3, rounds: int = 5) -> float:
    """Best mean seconds per call over ``rounds`` rounds of about ``min_s`` each."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def matmuls() -> None:
    print("matmuls, SmolLM2-135M shapes [rows x in -> out]:")
    mm = packed_linear.PackedLinears(enabled=True)
    gen = torch.Generator().manual_seed(0)
    for rows, k, n in [(64, 576, 1536), (64, 1536, 576), (64, 576, 576), (64, 576, 192),
                       (2318, 576, 1536), (2318, 1536, 576), (5355, 576, 1536)]:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        flop = 2 * rows * k * n
        a, b = best_time(lambda: F.linear(x, w)), best_time(lambda: mm(x, w))
        print(f"  {rows:5d} x {k:4d} -> {n:4d}: F.linear {a * 1e3:7.3f} ms "
              f"({flop / a / 1e9:5.1f} GFLOP/s), packed {b * 1e3:7.3f} ms "
              f"({flop / b / 1e9:5.1f} GFLOP/s): {a / b:.2f}x")
    x, head = torch.randn(64, 576, generator=gen), torch.randn(49152, 576, generator=gen) / 24

    def sliced(width: int = 1024):
        out = x.new_empty(64, head.shape[0])
        for s in range(0, head.shape[0], width):
            out[:, s:s + width] = F.linear(x, head[s:s + width])
        return out

    a, s, b = (best_time(lambda: F.linear(x, head)), best_time(sliced),
               best_time(lambda: mm(x, head)))
    print(f"  LM head 64 x 576 -> 49152: F.linear {a * 1e3:.1f} ms, in 1024-row slices "
          f"{s * 1e3:.1f} ms, packed {b * 1e3:.1f} ms: {s / b:.2f}x the slices")


def norms() -> None:
    print("RMSNorm at decode shapes:")
    gen = torch.Generator().manual_seed(0)
    for shape in [(64, 1, 128), (64, 1, 4, 32), (64, 1, 576)]:
        x, w = torch.randn(shape, generator=gen), torch.rand(shape[-1], generator=gen)
        a = best_time(lambda: F.rms_norm(x, w.shape, w, 1e-6))
        b = best_time(lambda: fast_kernels.rms_norm(x, w, 1e-6))
        print(f"  {str(shape):15s}: F.rms_norm {a * 1e6:5.1f} us, C {b * 1e6:5.1f} us: "
              f"{a / b:.2f}x")


def decode_attention() -> None:
    print("decode attention, batch 64 of mixed lengths, one layer:")
    gen = torch.Generator().manual_seed(0)
    width = 192
    for name, hkv, g, d in [("tiny-qwen3", 2, 2, 32), ("SmolLM2-135M", 3, 3, 64)]:
        lens = torch.randint(10, 161, (64,), generator=gen) + 20
        k = torch.randn(64, hkv, width, d, generator=gen)
        v = torch.randn(64, hkv, width, d, generator=gen)
        q = torch.randn(64, hkv * g, 1, d, generator=gen)
        real = torch.arange(width)[None] >= (width - lens)[:, None]
        mask = torch.zeros(64, 1, 1, width).masked_fill_(
            ~real[:, None, None], torch.finfo(torch.float32).min)
        flop = 4 * int(lens.sum()) * hkv * g * d  # q.k and p.v over the real columns
        a = best_time(lambda: fast_kernels.folded_attention(q, k, v, mask, d ** -0.5))
        b = best_time(lambda: fast_kernels.gqa_attention_forward(None, q, k, v, mask,
                                                                 scaling=d ** -0.5))
        print(f"  {name:12s} ({hkv} KV heads x {g}, head dim {d}): torch {a * 1e6:6.0f} us, "
              f"C {b * 1e6:6.0f} us ({flop / b / 1e9:4.1f} GFLOP/s): {a / b:.2f}x")


def prefill_attention() -> None:
    print("prefill attention, fresh prompts packed end to end, one layer (causal, each prompt "
          "to itself):")
    gen = torch.Generator().manual_seed(0)
    shapes = [("tiny-qwen3", 2, 2, 32), ("SmolLM2-135M", 3, 3, 64), ("Qwen3-0.6B", 8, 2, 128)]
    for prompts, lo, hi in [(64, 8, 160), (4, 256, 256), (2, 512, 512), (1, 1024, 1024)]:
        lens = torch.randint(lo, hi + 1, (prompts,), generator=gen)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        n = int(bounds[-1])
        print(f"  {prompts} prompts of {lo}-{hi} tokens ({n} tokens):")
        for name, hkv, g, d in shapes:
            q = torch.randn(n, hkv * g, d, generator=gen)
            k, v = (torch.randn(n, hkv, d, generator=gen) for _ in range(2))
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))

            def sdpa():  # lean.Packed.causal_attention's path for long prompts
                for s, e in zip(bounds.tolist(), bounds[1:].tolist()):
                    F.scaled_dot_product_attention(qs[:, :, s:e], ks[:, :, s:e], vs[:, :, s:e],
                                                   is_causal=True, scale=d ** -0.5,
                                                   enable_gqa=True)

            a = best_time(sdpa)
            b = best_time(lambda: fast_kernels.varlen_causal_attention(q, k, v, bounds,
                                                                       d ** -0.5))
            print(f"    {name:12s} ({hkv} KV heads x {g}, head dim {d:3d}): SDPA per prompt "
                  f"{a * 1e3:6.2f} ms, C {b * 1e3:6.2f} ms: {a / b:.2f}x")


def main() -> None:
    usable = packed_linear.available()
    engine = "uses them" if usable and packed_linear.pays_off() else "uses F.linear"
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), 1 thread; "
          f"oneDNN packed matmuls {'available (the engine ' + engine + ')' if usable else 'OFF'}; "
          f"C kernels {'built' if native.load() is not None else 'MISSING'}")
    with torch.no_grad():
        matmuls()
        norms()
        decode_attention()
        prefill_attention()


if __name__ == "__main__":
    main()
