"""bfloat16 against float32 on this CPU: a GEMM and a model's prefill and decode step.

    python scripts/bench_cpu_bf16.py [--model tiny-qwen3] [--batch 64] [--prompt-len 32]

Whether torch has a bf16 matrix path here (oneDNN's bf16 kernels need AVX512-BF16, AMX or
AVX-NE-CONVERT; without them ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False),
then, one torch thread, each timing in float32 and in bfloat16 side by side: a
512x1024x1024 linear, the model's prefill of ``--batch`` prompts of ``--prompt-len``
tokens, and one decode step of the batch over that KV cache. Why a bf16 engine
(``rollout.dtype=bfloat16``) is fast or slow on this box.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up: kernels chosen, buffers allocated
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5, help="best of N")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from rollout.models import resolve_model_path

    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert")
    print("CPU flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted))
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN bf16 supported: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    path = resolve_model_path(args.model)
    ids = torch.randint(3, 100, (args.batch, args.prompt_len))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        a, w = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        gemm = best_of(lambda: torch.nn.functional.linear(a, w), args.repeat)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            prefill = best_of(lambda: model(ids, use_cache=True), args.repeat)
            cache = model(ids, use_cache=True).past_key_values
            step = ids[:, -1:]
            # Each decode step appends to the cache; the cache grows by ``repeat + 1`` tokens.
            decode = best_of(lambda: model(step, past_key_values=cache, use_cache=True),
                             args.repeat)
        rows.append((str(dtype).removeprefix("torch."), gemm, prefill, decode))
    print(f"\n{args.model}, batch {args.batch}, prompt {args.prompt_len} tokens, 1 thread, "
          f"best of {args.repeat}\n")
    print("| dtype | 512x1024x1024 linear ms | GFLOP/s | prefill ms | decode step ms |")
    print("|---|---:|---:|---:|---:|")
    for name, gemm, prefill, decode in rows:
        print(f"| {name} | {gemm * 1e3:.1f} | {2 * 512 * 1024 * 1024 / gemm / 1e9:.1f} | "
              f"{prefill * 1e3:.1f} | {decode * 1e3:.2f} |")
    (_, g32, p32, d32), (_, g16, p16, d16) = rows
    print(f"\nbf16 / fp32 time: linear {g16 / g32:.2f}x, prefill {p16 / p32:.2f}x, "
          f"decode {d16 / d32:.2f}x")


if __name__ == "__main__":
    main()
