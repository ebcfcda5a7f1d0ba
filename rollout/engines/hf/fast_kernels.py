"""Savings for small models on CPU, all exact (eager's math, up to float rounding):

- ``homegym_gqa`` attention, decode: eager attention without ``repeat_kv``. Eager
  attention copies every layer's whole K/V cache G times per decode step to expand grouped
  KV heads; here the G query heads that share a KV head are folded into the query-length
  axis, so K/V are read in place. Profiled: the repeat_kv copies were ~40% of decode time.
  For one query per row this beats SDPA (0.26 vs 0.31 ms per layer, tiny-qwen3, batch 64
  x 130 cached tokens).
- ``homegym_gqa`` attention, prefill: SDPA with the same additive mask. Its blocked kernel
  never materializes the scores and is 2.5-3x faster than eager on prefill chunks
  (batch 16 x 160 tokens: 3.9 vs 12.7 ms per layer for tiny-qwen3, 14.5 vs 36 ms for
  SmolLM2-135M).
- ``GrowingLayer``: a KV cache layer with spare capacity, written in place, instead of
  DynamicLayer's ``torch.cat`` (which copies the whole cache at every step).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

ATTN_NAME = "homegym_gqa"


def gqa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          **kwargs):
    b, h, q, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    g = h // hkv
    if scaling is None:
        scaling = d ** -0.5
    if q > 1:  # prefill: SDPA's blocked kernel, 2.5-3x eager's materialized scores on CPU
        mask = None if attention_mask is None else attention_mask[:, :, :, :t]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    # Query head i uses KV head i // g (repeat_kv's layout): [b, hkv, g*q, d].
    qg = query.reshape(b, hkv, g * q, d)
    scores = torch.matmul(qg, key.transpose(2, 3)) * scaling
    if attention_mask is not None:  # eager's additive mask [b, 1, q, >=t]
        scores = scores.view(b, hkv, g, q, t) + attention_mask[:, :, None, :, :t]
        scores = scores.view(b, hkv, g * q, t)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [b, hkv, g*q, d]
    return out.view(b, h, q, d).transpose(1, 2).contiguous(), None


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

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        if self._len + n > self._kbuf.shape[2]:  # grow geometrically: amortized O(1) copies
            self.set(self.keys, self.values, spare=max(64, self._len) + n)
        self._kbuf[:, :, self._len:self._len + n] = key_states
        self._vbuf[:, :, self._len:self._len + n] = value_states
        self._len += n
        self.keys, self.values = self._kbuf[:, :, :self._len], self._vbuf[:, :, :self._len]
        return self.keys, self.values
