"""Gated DeltaNet layers in shared-prefix micro-batches (``batching.build_shared_prefix_micro_batch``).

The prefix pass runs each distinct prefix once and keeps every Gated DeltaNet layer's final
state (conv tail and recurrent state, with grad), as attention layers keep their KV. The
suffix pass runs the packed suffixes as sequences of their own (``cu_seqlens``), each
starting from its prefix's state: what the suffix would have seen had the whole sample run
in one piece, and the gradient of a shared prefix's state sums over its suffixes.
"""

from __future__ import annotations

import torch

from rollout.modeling.gated_deltanet import GDNState
from rollout.modeling.hybrid import GDNBatch
from trainer.training.backends.batching import SharedPrefix


def prefix_batch() -> GDNBatch:
    """For the prefix pass: collect each layer's final states (one per prefix)."""
    return GDNBatch(final_states={})


def suffix_batch(prefix: GDNBatch, layout: SharedPrefix) -> GDNBatch:
    """For the suffix pass: the packed suffixes' boundaries, each row seeded by its
    prefix's states."""
    lengths = torch.bincount(layout.slot // layout.width, minlength=layout.rows)
    cu = torch.zeros(layout.rows + 1, dtype=torch.long, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    index = layout.prefix_index
    states = {layer: GDNState(*(s.index_select(0, index) for s in state))
              for layer, state in prefix.final_states.items()}
    return GDNBatch(cu_seqlens=cu, initial_states=states)
