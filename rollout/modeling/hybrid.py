"""transformers' hybrid models (Qwen3.5) with homegym's Gated DeltaNet in their linear-attention
layers, so a forward can run packed sequences and carry recurrent state between forwards.

``use_homegym_gdn(model)`` swaps the class of every Gated DeltaNet layer of a loaded model
(parameters, names and state dict unchanged) for one whose forward runs
``rollout.modeling.gated_deltanet``. A forward then takes an optional ``gdn`` keyword
(transformers hands extra forward keywords down to every layer), a ``GDNBatch``:

- ``cu_seqlens``: the input is one row of packed sequences with these boundaries; each
  sequence starts from its own state (never the previous sequence's tokens);
- ``initial_states``: per layer index, the state each sequence starts from;
- ``final_states``: a dict the layers fill with each sequence's final state (with grad).

Without ``cu_seqlens`` each row is a sequence; a 2D padding mask (what transformers hands
these layers for padded input) packs each row's real tokens, so a right-padded row's final
state is the one after its last real token, not after its padding. A forward with a
transformers cache and no ``gdn`` keeps transformers' own layer (``generate``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from rollout.modeling.gated_deltanet import GDNState, gated_deltanet


class GDNBatch:
    """How one forward's Gated DeltaNet layers see their sequences (the ``gdn`` keyword).

    A plain class, not a dataclass: FSDP2's root pre-forward rebuilds dataclasses and dicts
    it finds in forward arguments (to move and cast their tensors), and the layers would
    then fill a copy's ``final_states``."""

    __slots__ = ("cu_seqlens", "initial_states", "final_states")

    def __init__(self, cu_seqlens: Optional[torch.Tensor] = None,
                 initial_states: Optional[dict[int, GDNState]] = None,
                 final_states: Optional[dict[int, GDNState]] = None):
        self.cu_seqlens = cu_seqlens  # [N + 1]: the [1, T] input is N packed sequences
        self.initial_states = initial_states  # layer index -> the N sequences' states
        self.final_states = final_states  # filled by the layers (layer index -> states)


class HomegymGatedDeltaNet:
    """Mixed in before transformers' Gated DeltaNet class (``use_homegym_gdn``)."""

    def forward(self, hidden_states: torch.Tensor, cache=None,
                attention_mask: Optional[torch.Tensor] = None, gdn: Optional[GDNBatch] = None,
                **kwargs) -> torch.Tensor:
        if gdn is None and cache is not None:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask,
                                   **kwargs)
        gdn = gdn or GDNBatch()
        initial = (gdn.initial_states or {}).get(self.layer_idx)
        if gdn.cu_seqlens is not None or attention_mask is None:
            out, final = gated_deltanet(self, hidden_states, cu_seqlens=gdn.cu_seqlens,
                                        initial_state=initial)
        else:  # padded rows: run each row's real tokens as one packed sequence
            out, final = _unpadded(self, hidden_states, attention_mask.bool(), initial)
        if gdn.final_states is not None:
            gdn.final_states[self.layer_idx] = final
        return out


def _unpadded(layer, hidden: torch.Tensor, mask: torch.Tensor, initial):
    rows, length, width = hidden.shape
    real = mask.flatten().nonzero().squeeze(1)
    cu = torch.zeros(rows + 1, dtype=torch.long, device=hidden.device)
    cu[1:] = mask.sum(1).cumsum(0)
    packed = hidden.reshape(rows * length, width).index_select(0, real)[None]
    out, final = gated_deltanet(layer, packed, cu_seqlens=cu, initial_state=initial)
    full = out.new_zeros(rows * length, out.shape[-1]).index_copy(0, real, out[0])
    return full.view(rows, length, -1), final


def is_gated_deltanet(module: torch.nn.Module) -> bool:
    """A linear-attention layer in Qwen3.5's layout (separate q/k/v and z projections)."""
    return all(hasattr(module, name) for name in (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias"))


def use_homegym_gdn(model: torch.nn.Module) -> int:
    """Route every Gated DeltaNet layer of ``model`` through homegym's implementation;
    returns how many there are (0: not a hybrid model, nothing changed)."""
    count = 0
    for module in model.modules():
        if isinstance(module, HomegymGatedDeltaNet) or not is_gated_deltanet(module):
            continue
        module.__class__ = _homegym_class(type(module))
        count += 1
    return count


@functools.lru_cache(maxsize=None)
def _homegym_class(cls: type) -> type:
    return type(f"Homegym{cls.__name__}", (HomegymGatedDeltaNet, cls), {})


# Parameters that stay fp32 in checkpoints and engines whatever the model's dtype: the GDN
# decay rate (SGLang 0.5.18's qwen3_5.py declares A_log float32; exp(A_log) in bf16 loses
# the small decays). Pushing them in bf16 would change the engine's numbers.
FP32_PARAMS = frozenset({"A_log"})


def transfer_dtype(name: str, dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype to send or store tensor ``name`` in when the model goes in ``dtype``."""
    if dtype is not None and name.rsplit(".", 1)[-1] in FP32_PARAMS:
        return torch.float32
    return dtype
