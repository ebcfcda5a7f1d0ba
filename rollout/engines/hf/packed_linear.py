"""The engine's matmuls on weights prepacked for oneDNN.

``F.linear`` on CPU calls MKL's sgemm, which re-packs the weight into its kernel's tile
layout on every call. oneDNN (torch's ``mkldnn`` ops, in every x86 build of torch) can
pack a weight once and run its brgemm kernels on the packed copy. On this box's Zen 4 core,
one thread: 110-114 vs 95-99 GFLOP/s at SmolLM2-135M's shapes, both decode (batch 64)
and prefill (1-5k tokens); the LM head at batch 64, 36.6 vs 48.2 ms (MKL in vocabulary
slices) or 60.7 ms (MKL whole). Results agree with ``F.linear`` to float rounding (a
different summation order: ~5e-6 on unit-scale outputs), not bitwise.

A packed copy is made on first use and kept while the weight is unchanged: the key is the
weight's storage address, shape and version counter, which every in-place write bumps
(the engine's weight updates copy into the parameters), so an update repacks lazily on the
next forward (SmolLM2: ~0.3 s for all 135M weights). It doubles the memory of the packed
weights; ``clear()`` frees them (the engine calls it before releasing memory).

Small matmuls keep ``F.linear``: oneDNN's per-call overhead (~10 us) outweighs its gain
below ~8M multiply-adds (tiny-qwen3's 128x384 weight at batch 64: 71 vs 69 us; at 512
rows, a prefill, oneDNN is 1.14x faster). Also unpacked: other dtypes, weights that need
grad under autograd, and ``HOMEGYM_NATIVE_KERNELS=0``.

Packing is chosen at start-up by what the CPU has: oneDNN's kernels win with AVX-512 (the
figures above) and lose without it. On a Zen 3 core (AVX2 only), SmolLM2's shapes: packed
at 0.78-0.90x MKL's speed, decode and prefill alike (``scripts/bench_engine_kernels.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Pack a weight this large, or any weight multiplied by enough rows at once (prefill).
MIN_ELEMENTS = 1 << 16
MIN_MACS = 1 << 23


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """oneDNN's packed linear is there and computes F.linear: the ops are private to torch,
    so a torch whose build or signatures differ gets F.linear instead of an error."""
    if (os.environ.get("HOMEGYM_NATIVE_KERNELS", "1") == "0"
            or not torch.backends.mkldnn.is_available()):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen) for s in ((3, 16), (8, 16), (8,)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        ok = bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5))
    except (AttributeError, RuntimeError, TypeError) as exc:
        log.warning("oneDNN packed matmuls unavailable (%s): the engine uses F.linear", exc)
        return False
    if not ok:
        log.warning("oneDNN packed matmul disagrees with F.linear: the engine uses F.linear")
    return ok


@functools.lru_cache(maxsize=None)
def pays_off() -> bool:
    """Whether packing is faster than MKL on this CPU: where torch dispatches AVX-512."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class PackedLinears:
    """``F.linear(x, weight, bias)`` that runs packed copies of the large float32 weights.
    ``enabled``: pack where oneDNN works and pays off on this CPU (the default), or force."""

    def __init__(self, enabled: Optional[bool] = None):
        self.enabled = available() and (pays_off() if enabled is None else enabled)
        self._packs: dict[int, tuple[tuple, torch.Tensor]] = {}  # id(weight) -> (key, packed)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        packed = self.pack_for(x, weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def packs(self, rows: int, weight: torch.Tensor) -> bool:
        """Whether ``rows`` rows times ``weight`` are big enough to run packed here."""
        return self.enabled and (weight.numel() >= MIN_ELEMENTS
                                 or rows * weight.numel() >= MIN_MACS)

    def pack_for(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed copy of ``weight`` to multiply ``x`` by (made or refreshed now), or
        None where ``F.linear`` is faster or the only choice."""
        if not self.packs(x.numel() // x.shape[-1], weight):
            return None
        if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
                or (weight.requires_grad and torch.is_grad_enabled())):
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride())
        hit = self._packs.get(id(weight))
        if hit is not None and hit[0] == key:
            return hit[1]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self._packs[id(weight)] = (key, packed)
        return packed

    def clear(self) -> None:
        self._packs.clear()

    def __len__(self) -> int:  # packed weights held
        return len(self._packs)
