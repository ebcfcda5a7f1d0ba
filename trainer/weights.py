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

import ray
import torch

from rollout.engines.weights_io import checksum


GROUP_NAME = "homegym_weights"


class WeightSyncError(RuntimeError):
    pass


def bucket_checksum(bucket: Iterable[tuple[str, torch.Tensor]]) -> float:
    """The engines' end-to-end check value for one bucket of named tensors."""
    return checksum(t for _, t in bucket)


class WeightSync:
    def __init__(self, config, train_group, engines, *, mode: str = "tensor") -> None:
        if mode not in ("tensor", "distributed"):
            raise ValueError(f"weight sync mode must be tensor or distributed (got {mode!r})")
        self.config = config
        self.train_group = train_group
        self.engines = engines
        self.mode = mode
        self.bucket_bytes = config.train.weight_bucket_mb * 2**20
        self._group_ready = False

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
                    bucket, version=version if last else None, checksum=bucket_checksum(bucket))
            except Exception as err:
                raise WeightSyncError(f"weight update to version {version} failed on bucket "
                                      f"{i + 1}/{len(buckets)}: {err}") from err
        return num_bytes, len(buckets)

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        address, port = self.train_group.weight_rendezvous()
        world_size = 1 + len(self.engines.engines)
        backend = "nccl" if self.config.cluster.device == "cuda" else "gloo"
        engine_refs = self.engines.init_weights_update_group(
            address, port, world_size=world_size, group_name=GROUP_NAME, backend=backend)
        trainer_ref = self.train_group.init_weight_broadcast(address, port, world_size, GROUP_NAME)
        results = ray.get(engine_refs + [trainer_ref])
        failed = [r for r in results[:-1] if not (isinstance(r, dict) and r.get("success", True))]
        if failed:
            raise WeightSyncError(f"engines could not join the weight-update group: {failed}")
        self._group_ready = True

    def _push_distributed(self, version: int) -> tuple[int, int]:
        self._ensure_group()
        buckets = self.train_group.stage_weights(self.bucket_bytes)
        # Engines take their update calls in order, each blocking until its tensors arrive;
        # the trainer then broadcasts every bucket in the same order.
        refs = []
        for i, b in enumerate(buckets):
            last = i == len(buckets) - 1
            refs += self.engines.update_weights_from_distributed(
                b["names"], b["dtypes"], b["shapes"], group_name=GROUP_NAME,
                version=version if last else None, checksum=b["checksum"])
        ray.get(self.train_group.broadcast_staged())
        try:
            results = ray.get(refs)
        except Exception as err:
            raise WeightSyncError(f"weight update to version {version} failed: {err}") from err
        failed = [r for r in results if isinstance(r, dict) and not r.get("success", True)]
        if failed:
            raise WeightSyncError(f"weight update to version {version} failed: {failed[0]}")
        return sum(b["bytes"] for b in buckets), len(buckets)

    def verify(self, version: int) -> None:
        reported = self.engines.weight_versions()
        stale = [i for i, v in enumerate(reported) if str(v) != str(version)]
        if stale:
            raise WeightSyncError(f"engines {stale} report weight versions "
                                  f"{[reported[i] for i in stale]} after pushing version {version}")
