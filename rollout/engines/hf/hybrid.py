"""The engine's forward pass for Qwen3.5's hybrid decoder: Gated DeltaNet layers, which
carry a recurrent state per sequence instead of a KV cache, and gated full-attention layers.

What a running row holds (``HybridCache``): the K/V of the attention layers, as for any
model, plus per GDN layer its conv state (the last ``kernel - 1`` inputs of the short
causal conv) and its recurrent state ``[value heads, key dim, value dim]``. Both are
exact summaries of everything the row has fed, so a row continues from them alone:

- a prefill runs the chunk's real tokens packed, each row's GDN run starting from its own
  states (zeros, or the states a finished sequence left in the prefix cache);
- a decode step advances every row's states by one token in place.

Same math and order of operations as transformers' forward of ``Qwen3_5ForCausalLM``
(its (1 + w) RMSNorms, the gated attention's output gate, partial rotary, the GDN's gated
norm); the conv and the delta rule are rollout/modeling/gated_deltanet.py's, which the
trainer runs too. Results agree with transformers' forward to float rounding
(tests/test_engine_hybrid.py).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from rollout.checkpoints import cpu_engine_refusal
from rollout.engines.hf.fast_kernels import gqa_attention_forward
from rollout.engines.hf.lean import LeanForward, Packed, _unpack
from rollout.modeling.gated_deltanet import (GDNState, empty_state, gated_deltanet,
                                             gated_deltanet_step_)

# Chunk lengths of the delta rule in a prefill: the smallest that holds the longest row.
CHUNK_SIZES = (16, 32, 64)


def layer_types(config) -> tuple:
    return tuple(getattr(config, "layer_types", None) or ())


def is_hybrid(config) -> bool:
    """Whether some layer keeps a recurrent state instead of a KV cache."""
    return any(t != "full_attention" for t in layer_types(config))


def refusal(model) -> Optional[str]:
    """Why this engine cannot serve ``model`` (a hybrid model it keeps no state for), as
    the one-line start-up error; None when it can."""
    return cpu_engine_refusal(model.config.to_dict())


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    # The module's own math (Qwen3.5's (1 + w) RMSNorm upcasts), without the hook dispatch.
    return type(norm).forward(norm, x)


class HybridCache:
    """A forward's state: ``layers`` the attention layers' K/V (cache layers, in layer
    order), ``states`` per GDN layer its (conv [B, conv dim, kernel - 1], recurrent
    [B, value heads, key dim, value dim]) state, written in place."""

    def __init__(self, layers: list, states: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers
        self.states = states


class HybridForward(LeanForward):
    """``__call__(input_ids, attention_mask, position_ids, cache: HybridCache)`` -> logits
    at each row's last position [B, vocab]. A prefill (T > 1) runs packed; rows may bring
    a cached past (attention K/V in the left columns, GDN states in ``cache.states``)."""

    def __init__(self, model):
        super().__init__(model)
        self.types = layer_types(model.config)
        self.apply_rope = sys.modules[type(model).__module__].apply_rotary_pos_emb

    def _read_modules(self) -> None:
        """Nothing read ahead: this forward takes its modules as it goes."""

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        b, t = input_ids.shape
        packed = None
        if t > 1:
            packed = Packed(attention_mask[:, -t:].bool(), past=attention_mask.shape[1] - t)
        return self._forward(input_ids, attention_mask, position_ids, cache, packed)

    def _forward(self, input_ids, attention_mask, position_ids, cache, packed):
        inner = self.inner
        b, t = input_ids.shape
        if packed is None:
            x = inner.embed_tokens(input_ids)
            cos, sin = inner.rotary_emb(x, position_ids)
        else:
            x = inner.embed_tokens(input_ids.reshape(-1)[packed.flat])[None]  # [1, N, hidden]
            cos, sin = inner.rotary_emb(x, position_ids.reshape(-1)[packed.flat][None])
        per_row = packed is not None and packed.past == 0
        mask = None if per_row else self._mask(attention_mask, t, x.dtype)
        cu_seqlens = None if packed is None else torch.tensor(packed.bounds)
        attn_i = gdn_i = 0
        for layer, kind in zip(inner.layers, self.types):
            h = _norm(layer.input_layernorm, x)
            if kind == "linear_attention":
                out = self._gdn(layer.linear_attn, h, cache.states[gdn_i], cu_seqlens)
                gdn_i += 1
            else:
                out = self._attention(layer.self_attn, h, cos, sin, cache.layers, attn_i,
                                      packed, per_row, mask, b, t)
                attn_i += 1
            x.add_(out)
            mlp = layer.mlp
            h = _norm(layer.post_attention_layernorm, x)
            act = F.silu(self._linear(h, mlp.gate_proj), inplace=True)
            x.add_(self._linear(act.mul_(self._linear(h, mlp.up_proj)), mlp.down_proj))
        if packed is None:
            x = x[:, -1:]
        else:  # each row's last token is real: the ends of the rows' runs in packed order
            x = x[0, packed.ends - 1][:, None]
        return self._logits(_norm(inner.norm, x)[:, -1]).float()

    def _attention(self, attn, h, cos, sin, layers, i, packed, per_row, mask, b, t):
        """Gated full attention: q_proj gives per head [query | gate]; the output is
        multiplied by sigmoid(gate) before o_proj. ``layers[i]``: its cache layer."""
        rows, n = h.shape[0], h.shape[1]
        d = attn.head_dim
        q, gate = torch.chunk(self._linear(h, attn.q_proj).view(rows, n, -1, 2 * d), 2, dim=-1)
        gate = gate.reshape(rows, n, -1)
        q = _norm(attn.q_norm, q).transpose(1, 2)
        k = _norm(attn.k_norm, self._linear(h, attn.k_proj).view(rows, n, -1, d)).transpose(1, 2)
        v = self._linear(h, attn.v_proj).view(rows, n, -1, d).transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin)
        if packed is None:
            k, v = layers[i].update(k, v)
            out, _ = gqa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
            out = out.reshape(b, t, -1)
        elif per_row:  # no past: each row attends to itself only, causally
            layers[i] = packed.kv_layer(k, v)
            out = packed.causal_attention(q, k, v, attn.scaling)
        else:  # rows with a cached past: attention on the padded layout
            flat = packed.flat
            q, k, v = (_unpack(z, flat, b, t) for z in (q, k, v))
            k, v = layers[i].update(k, v)
            out, _ = gqa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
            out = out.reshape(b * t, -1)[flat][None]
        return self._linear(out * torch.sigmoid(gate), attn.o_proj)

    @staticmethod
    def _gdn(la, h, states, cu_seqlens):
        """One Gated DeltaNet layer over ``h`` ([1, N, hidden] rows packed at
        ``cu_seqlens``, or [B, 1, hidden] one decode token per row), each row continuing
        from its ``states``, which are overwritten with the states after it."""
        conv, rec = states
        if cu_seqlens is None:
            return gated_deltanet_step_(la, h[:, 0], GDNState(conv, rec))[:, None]
        # The rule pads each row to whole chunks: a turn of a few tokens over a cached state
        # runs in 16-token chunks, not 64 (5x less GDN time for 13-token turns).
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out, new = gated_deltanet(la, h, cu_seqlens=cu_seqlens, initial_state=GDNState(conv, rec),
                                  chunk_size=next(c for c in CHUNK_SIZES if c >= min(longest, 64)))
        conv.copy_(new.conv)
        rec.copy_(new.recurrent)
        return out


def new_cache(model, rows: int) -> HybridCache:
    """A prefill's cache for ``rows`` forward rows without a past: attention layers that
    take the prefill's K/V, zero GDN states."""
    layers = model.model.layers
    return HybridCache([DynamicLayer() for layer in layers if hasattr(layer, "self_attn")],
                       [empty_state(layer.linear_attn, rows, dtype=model.dtype)
                        for layer in layers if hasattr(layer, "linear_attn")])
