"""Savings for small models on CPU, all exact (eager's math, up to float rounding):

- ``homegym_gqa`` attention, decode: a C kernel (csrc/kernels.c, built by
  native.py) that loads each K/V column once for two of the G query heads sharing it
  and skips the columns a row masks out. In a batch of mixed lengths those are most of a short
  row's columns: the running batch is as wide as its longest row. Without a C compiler,
  the same math in torch: eager attention with the G query heads folded into the
  query-length axis, so K/V are read in place instead of ``repeat_kv``'s G copies per
  step; for one query per row it beats SDPA.
- ``homegym_gqa`` attention, prefill: SDPA with the same additive mask. Its blocked kernel
  never materializes the scores, unlike eager.
- ``varlen_causal_attention``: a prefill of fresh prompts packed end to end (lean.py), each
  prompt causally to itself, in one C call where SDPA needs one per prompt.
- ``silu_mul_``: the gated MLP's silu(gate) * up in one C pass.
- ``rope_``: the rotary embedding in place by a C kernel, bitwise transformers'
  rotate-half form, one pass instead of five temporaries.
- ``rms_norm``: the Llama family's RMSNorm by a C kernel, one pass over each row where
  torch's CPU op is a composite of five dispatched ops with temporaries.

What each saves, measured: docs/performance.md ("Engine vs model.generate()" and
"Design figures").
- ``GrowingLayer``: a KV cache layer with spare capacity, written in place, instead of
  DynamicLayer's ``torch.cat`` (which copies the whole cache at every step).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from rollout.engines.hf import native

ATTN_NAME = "homegym_gqa"


def gqa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          **kwargs):
    q, t = query.shape[2], key.shape[2]
    if scaling is None:
        scaling = query.shape[3] ** -0.5
    if q > 1:  # prefill: SDPA's blocked kernel, 2.5-3x eager's materialized scores on CPU
        mask = None if attention_mask is None else attention_mask[:, :, :, :t]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    out = None
    if attention_mask is not None:  # decode: one query per row
        out = _native_decode(query, key, value, attention_mask, scaling)
    if out is None:
        out = folded_attention(query, key, value, attention_mask, scaling)
    return out, None


def folded_attention(query, key, value, attention_mask, scaling):
    """Eager attention with the G query heads of a KV head folded into the query axis:
    K/V are read in place instead of repeat_kv's copies. Returns [b, q, h, d]."""
    b, h, q, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    g = h // hkv
    # Query head i uses KV head i // g (repeat_kv's layout): [b, hkv, g*q, d].
    qg = query.reshape(b, hkv, g * q, d)
    scores = torch.matmul(qg, key.transpose(2, 3)) * scaling
    if attention_mask is not None:  # eager's additive mask [b, 1, q, >=t]
        scores = scores.view(b, hkv, g, q, t) + attention_mask[:, :, None, :, :t]
        scores = scores.view(b, hkv, g * q, t)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [b, hkv, g*q, d]
    return out.view(b, h, q, d).transpose(1, 2).contiguous()


def _native_decode(query, key, value, attention_mask, scaling):
    """The C decode kernel (rollout/engines/hf/csrc/kernels.c) where it applies:
    float32, the head dim contiguous. It reads only the columns a row attends to, so short
    rows in a mixed-length batch skip their padding; None means use the torch path."""
    lib = native.load()
    if (lib is None or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or attention_mask.dtype != torch.float32
            or key.stride(3) != 1 or value.stride(3) != 1 or query.device.type != "cpu"):
        return None
    b, h, _, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    mask = attention_mask[:, 0, 0, :t]
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    q = query.reshape(b, h, d).contiguous()
    out = torch.empty(b, 1, h, d)
    rc = lib.homegym_decode_attention(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr(), out.data_ptr(),
        b, hkv, h // hkv, t, d, key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0),
        float(scaling), _SKIP_BELOW)
    if rc != 0:
        raise MemoryError("decode attention: out of memory for its score buffer")
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotary embedding in place on q [B, T, H, D] and k [B, T, Hkv, D] (transformers'
    rotate-half form, bitwise) with cos/sin [B, T, D], by the C kernel; False where it does
    not apply (no kernel, not float32, not contiguous, partial rotary): use torch's."""
    lib = native.load()
    d = q.shape[-1]
    if (lib is None or cos.shape[-1] != d or d % 2
            or any(x.dtype != torch.float32 or not x.is_contiguous() for x in (q, k, cos, sin))
            or cos.shape[:2] != q.shape[:2] or sin.shape != cos.shape):
        return False
    m = q.shape[0] * q.shape[1]
    lib.homegym_rope(q.data_ptr(), cos.data_ptr(), sin.data_ptr(), m, q.shape[2], d)
    lib.homegym_rope(k.data_ptr(), cos.data_ptr(), sin.data_ptr(), m, k.shape[2], d)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The Llama family's RMSNorm over the last dim by the C kernel, into ``out`` (may be
    ``x``) or a new tensor; None where it does not apply (no kernel, not float32, not
    contiguous): use torch's. Float rounding differs from torch's composite (the sum of
    squares is accumulated in another order): ~1e-7 relative."""
    lib = native.load()
    d = x.shape[-1]
    if (lib is None or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not x.is_contiguous() or not weight.is_contiguous() or weight.numel() != d
            or x.device.type != "cpu"):
        return None
    if out is None:
        out = torch.empty_like(x)
    lib.homegym_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d,
                         float(eps))
    return out


def _kernel_ready(lib, *tensors) -> bool:
    return lib is not None and all(x.dtype == torch.float32 and x.device.type == "cpu"
                                   for x in tensors)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            bounds: torch.Tensor, scaling: float) -> Optional[torch.Tensor]:
    """Causal attention of sequences packed end to end, each attending only to itself, by
    the C kernel: q [N, h, d], k and v [N, hkv, d], ``bounds`` (int64) [R + 1] the
    sequences' starts and the end. Returns [N, h, d], or None where the kernel does not
    apply (no kernel, not float32, not contiguous): use per-sequence SDPA."""
    lib = native.load()
    if (not _kernel_ready(lib, q, k, v) or not all(x.is_contiguous() for x in (q, k, v))
            or bounds.dtype != torch.int64 or not bounds.is_contiguous()):
        return None
    out = torch.empty_like(q)
    rc = lib.homegym_varlen_causal_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), bounds.data_ptr(),
        bounds.numel() - 1, k.shape[1], q.shape[1] // k.shape[1], q.shape[2], float(scaling))
    if rc != 0:
        raise MemoryError("attention: out of memory for its score buffer")
    return out


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """gate = silu(gate) * up in place by the C kernel (one pass; its exp is a polynomial
    within ~2 ulp, torch's within 1: results agree to ~3e-7 relative); False where it does
    not apply (no kernel, not float32, not contiguous): use torch's."""
    lib = native.load()
    if (not _kernel_ready(lib, gate, up) or gate.shape != up.shape
            or not gate.is_contiguous() or not up.is_contiguous()):
        return False
    lib.homegym_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel())
    return True


@functools.lru_cache(maxsize=None)
def blas_sgemm() -> Optional[int]:
    """The address of the BLAS ``sgemm`` (Fortran interface, 32-bit integers) that torch's
    CPU library exports (MKL's, in x86 builds): what F.linear calls for float32, for the C
    decode step to call itself. None where torch has none or it does not compute F.linear
    (checked once on a small product)."""
    try:
        torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                             "libtorch_cpu.so"))
        fn = torch_cpu.sgemm
    except (OSError, AttributeError):
        return None
    i32p, fp = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
    fn.argtypes = [ctypes.c_char_p] * 2 + [i32p] * 3 + [fp] * 2 + [i32p, fp, i32p, fp, fp, i32p]
    fn.restype = None
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=gen), torch.randn(8, 16, generator=gen)
    out = torch.empty(3, 8)
    m, n, k = (ctypes.byref(ctypes.c_int(i)) for i in (3, 8, 16))
    ld_w, ld_x, ld_o = (ctypes.byref(ctypes.c_int(i)) for i in (16, 16, 8))
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    w_, x_, out_ = (ctypes.cast(t.data_ptr(), fp) for t in (w, x, out))
    fn(b"T", b"N", n, m, k, ctypes.byref(one), w_, ld_w, x_, ld_x, ctypes.byref(zero), out_,
       ld_o)
    if not torch.allclose(out, F.linear(x, w), atol=1e-5):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


# Additive masks use finfo.min for "masked"; anything this low contributes exp(-huge) = 0.
_SKIP_BELOW = torch.finfo(torch.float32).min / 2


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, gqa_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)
    return ATTN_NAME


class GrowingLayer(DynamicLayer):
    """KV storage [B, H, capacity, D]; ``keys``/``values`` are views of the used part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int = 64):
        super().__init__()
        self.set(keys, values, spare)

    def set(self, keys: torch.Tensor, values: torch.Tensor, spare: int = 64) -> None:
        b, h, t, d = keys.shape
        self._kbuf = keys.new_empty(b, h, t + spare, d)
        self._vbuf = values.new_empty(b, h, t + spare, d)
        self._kbuf[:, :, :t] = keys
        self._vbuf[:, :, :t] = values
        self._len = t
        self.keys, self.values = self._kbuf[:, :, :t], self._vbuf[:, :, :t]
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    @classmethod
    def from_buffers(cls, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> "GrowingLayer":
        """Adopt preallocated buffers (no copy); the first ``length`` columns are used."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._kbuf, layer._vbuf, layer._len = kbuf, vbuf, length
        layer.keys, layer.values = kbuf[:, :, :length], vbuf[:, :, :length]
        layer.is_initialized = True
        layer.dtype, layer.device = kbuf.dtype, kbuf.device
        return layer

    def appended(self, n: int = 1) -> None:
        """``n`` columns past the end were written in place: take them in."""
        self._len += n
        self.keys, self.values = self._kbuf[:, :, :self._len], self._vbuf[:, :, :self._len]

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        if self._len + n > self._kbuf.shape[2]:  # grow geometrically: amortized O(1) copies
            self.set(self.keys, self.values, spare=max(64, self._len) + n)
        self._kbuf[:, :, self._len:self._len + n] = key_states
        self._vbuf[:, :, self._len:self._len + n] = value_states
        self.appended(n)
        return self.keys, self.values
