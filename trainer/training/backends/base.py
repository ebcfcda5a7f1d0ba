"""The training backend protocol: one instance per training rank.

A backend owns the model replica/shard, the optimizer and the reference model of its
rank; the process group is already initialised by the caller (``TrainActor``). Every
method is called on all ranks with the same arguments, because the implementations run
collectives inside; results that matter are identical on every rank (metrics are
all-reduced, log-probs all-gathered), except ``named_weight_buckets`` which yields the
gathered tensors on every rank (callers keep rank 0's).

Shared, backend-neutral pieces: ``trainer.training.backends.batching`` (sharding,
micro-batches), ``trainer.training.algo.objective`` (the loss of a micro-batch),
``trainer.training.backends.schedule`` (LR).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

from trainer.training.backends.batching import BatchLike

NamedTensors = list[tuple[str, torch.Tensor]]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             nbytes: Callable[[torch.Tensor], int] = _nbytes) -> Iterator[NamedTensors]:
    """``(name, tensor)`` pairs in consecutive buckets of at most ``bucket_bytes`` (by
    ``nbytes``; a larger tensor is a bucket of its own). Lazy: a bucket is yielded as soon
    as the next tensor would overflow it, so a caller streams one bucket at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes})")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in items:
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


@runtime_checkable
class TrainBackend(Protocol):
    def init(self, model, train, algo, warmup, cluster, *, rank: int, world_size: int,
             share_prompts: bool, total_optimizer_steps: int) -> None:
        """Build model, optimizer and (if algo.kl_coef > 0) the frozen reference, from the
        config sections named (``warmup``: the SFT step's LR) and two derived values
        (``config.derived``: share_prompts, total_optimizer_steps, the LR decay horizon)."""

    def log_probs(self, batch: BatchLike) -> list[torch.Tensor]:
        """Per sample, the current policy's log-probs of its response tokens."""

    def train_step(self, batch: BatchLike) -> dict[str, float]:
        """One RL step on the whole batch (one or more optimizer steps); returns metrics."""

    def sft_step(self, batch: BatchLike) -> dict[str, float]:
        """One supervised optimizer step: mean NLL over loss_mask tokens."""

    def named_weight_buckets(self, bucket_bytes: int, device: str = "cpu",
                             dtype=None) -> Iterator[NamedTensors]:
        """Full (gathered) tensors under their Hugging Face names, in buckets of ~bytes,
        copied to ``device`` (cuda keeps them on the GPU for CUDA IPC / NCCL). ``dtype``:
        the dtype the caller will cast to (the engines'); a backend may gather in it to
        move fewer bytes, or yield its own dtype."""

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

