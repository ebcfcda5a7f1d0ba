"""``BatchRef``: a ``RolloutBatch`` left in Ray's object store, and the little the driver
needs to know of it.

The rollout manager puts each step's batch in the object store where it is made and hands
the driver a ``BatchRef``; the driver passes ``ref`` to every training rank as a top-level
argument, so each rank resolves it from the object store and the tokens never pass through
the driver. The driver keeps only what the loop reads: the sample count, group ids, labels
and weight versions (the ledger, the data-order log, the staleness filter), the metrics and
a digest of the tokens.

Lifetime: a ref is owned by the process that put it (the manager, or the driver for a batch
it restored from a checkpoint) and the object lives while anyone holds the ``BatchRef``;
the driver drops it once the ranks have trained, so the store holds only the batches queued
for training.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout.sample import RolloutBatch


def tokens_digest(tokens: list[list[int]]) -> str:
    """Short digest of a batch's token ids, in order (the run's data-order record)."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


@dataclass
class BatchRef:
    ref: ray.ObjectRef
    num_samples: int
    group_ids: list[int] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    tokens_sha256: str = ""

    def __len__(self) -> int:
        return self.num_samples

    @classmethod
    def put(cls, batch: RolloutBatch) -> "BatchRef":
        """Store ``batch`` (owned by the calling process) and describe it."""
        return cls(ref=ray.put(batch), num_samples=len(batch), group_ids=list(batch.group_ids),
                   labels=list(batch.labels), weight_versions=list(batch.weight_versions),
                   metrics=dict(batch.metrics), tokens_sha256=tokens_digest(batch.tokens))

    def get(self) -> RolloutBatch:
        """The whole batch, copied into this process (checkpoints only)."""
        return ray.get(self.ref)
