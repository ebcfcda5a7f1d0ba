"""Weight sync from the training ranks to the inference engines: bucketed, versioned, verified.

Each bucket travels with a checksum (the float64 sum of its tensors) that the engine
recomputes on what it received; a mismatch is rejected by the engine and raised here, and
the engine keeps its old weights. The version is attached to the last bucket only, so an
engine that reports the new version has loaded every bucket; `push` then checks that every
engine reports it. Paths:
- ``tensor``: same host (colocated): tensors handed over through shared memory, SGLang's
  `update_weights_from_tensor` (CUDA IPC on GPU).
- ``distributed``: the trainer's rank 0 broadcasts over a torch.distributed group the
  engines joined (`init_weights_update_group` + `update_weights_from_distributed`; gloo on
  CPU, NCCL on GPU). For disaggregated engines on other GPUs or nodes.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch


class WeightSyncError(RuntimeError):
    pass


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Order-independent float64 sum over every element (cheap, catches partial updates)."""
    total = 0.0
    for _, tensor in named_tensors:
        total += float(tensor.detach().to(torch.float64).sum())
    return total


class WeightSync:
    def __init__(self, config, train_group, engines, *, mode: str = "tensor") -> None:
        if mode not in ("tensor", "distributed"):
            raise ValueError(f"weight sync mode must be tensor or distributed (got {mode!r})")
        self.config = config
        self.train_group = train_group
        self.engines = engines
        self.mode = mode
        self.bucket_bytes = config.train.weight_bucket_mb * 2**20

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.mode == "tensor":
            num_bytes, num_buckets = self._push_tensors(version)
        else:
            num_bytes, num_buckets = self._push_distributed(version)
        self.verify(version)
        return {"perf/weight_sync_time": time.perf_counter() - start,
                "perf/weight_sync_bytes": float(num_bytes),
                "perf/weight_sync_buckets": float(num_buckets)}

    def _push_tensors(self, version: int) -> tuple[int, int]:
        buckets = self.train_group.named_weight_buckets(self.bucket_bytes)
        num_bytes = 0
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            try:
                self.engines.update_weights_from_tensor(
                    bucket, version=version if last else None, checksum=checksum(bucket))
            except Exception as err:
                raise WeightSyncError(f"weight update to version {version} failed on bucket "
                                      f"{i + 1}/{len(buckets)}: {err}") from err
        return num_bytes, len(buckets)

    def _push_distributed(self, version: int) -> tuple[int, int]:
        raise NotImplementedError("distributed weight sync is wired by the async loop")

    def verify(self, version: int) -> None:
        reported = self.engines.weight_versions()
        stale = [i for i, v in enumerate(reported) if str(v) != str(version)]
        if stale:
            raise WeightSyncError(f"engines {stale} report weight versions "
                                  f"{[reported[i] for i in stale]} after pushing version {version}")
