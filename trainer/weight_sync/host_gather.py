"""Gathering dim-0-sharded DTensors through shared memory when every rank is on one host.

FSDP's ``full_tensor()`` gathers over the process group; on CPU that is gloo over TCP
loopback, one collective per tensor. Ranks that share a host can instead write their
shards straight into one /dev/shm buffer per bucket, which every rank maps: after a
barrier each rank reads the full tensors there, at memory speed. Used for weight sync and
export (``FSDPBackend.named_weight_buckets``); anything it cannot do (ranks on several
hosts, a placement other than a 1-D ``Shard(0)``) falls back to ``full_tensor()``.

Each bucket's buffer is created by rank 0 once and reused while the bucket's layout stays
the same (the model's shapes do not change during a run); peers open it through
torch's file_system sharing (the handles travel once, by ``broadcast_object_list``).
The tensors yielded are copies, so a caller may keep them after the next gather.
"""

from __future__ import annotations

import os
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of a dim-0 shard (torch.chunk's split, as DTensor's Shard)."""
    per = -(-rows // world) if rows else 0
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def _sharded_on_dim0(value) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(value, DTensor) and value.device_mesh.ndim == 1
            and len(value.placements) == 1 and isinstance(value.placements[0], Shard)
            and value.placements[0].dim == 0)


class HostGather:
    """One per backend; ``usable`` says whether all ranks share a host (collective once)."""

    def __init__(self, rank: int, world_size: int, group=None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        hosts: list = [None] * world_size
        dist.all_gather_object(hosts, _host_id(), group=group)
        self.usable = world_size > 1 and len(set(hosts)) == 1 and os.path.isdir("/dev/shm")
        self._buffers: dict[int, tuple[tuple, torch.Tensor]] = {}

    def can_gather(self, values: Sequence) -> bool:
        """Whether every value can take this path (collectively agreed: the same answer
        on every rank, since placements are the same everywhere)."""
        return self.usable and all(_sharded_on_dim0(v) and v.device.type == "cpu" for v in values)

    def _buffer(self, key: int, layout: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from rollout.engines.weights_io import MultiprocessingSerializer

        held = self._buffers.get(key)
        if held is not None and held[0] == layout:
            return held[1]
        handle: list = [None]
        if self.rank == 0:
            import torch.multiprocessing as mp

            # A /dev/shm file that an unrelated process (the peer rank) can open by name.
            mp.set_sharing_strategy("file_system")
            flat = torch.empty(numel, dtype=dtype).share_memory_()
            handle[0] = MultiprocessingSerializer.serialize(flat)
        dist.broadcast_object_list(handle, src=0, group=self.group)
        if self.rank != 0:
            flat = MultiprocessingSerializer.deserialize(handle[0])
        self._buffers[key] = (layout, flat)
        return flat

    def gather(self, key: int, named: Sequence[tuple[str, "torch.Tensor"]],
               dtype: Optional[torch.dtype] = None) -> list[tuple[str, torch.Tensor]]:
        """Full copies of ``named`` (DTensors, ``can_gather``), cast to ``dtype`` (None:
        their own, which must be one for all), as (name, tensor). Collective: every rank
        calls it with the same ``key`` and names."""
        dtypes = {dtype or v.dtype for _, v in named}
        if len(dtypes) != 1:
            raise ValueError(f"one dtype per gathered bucket (got {sorted(map(str, dtypes))})")
        out_dtype = dtypes.pop()
        layout = tuple((n, tuple(v.shape)) for n, v in named) + (out_dtype,)
        flat = self._buffer(key, layout, sum(v.numel() for _, v in named), out_dtype)
        views, offset = [], 0
        for name, value in named:
            full = flat[offset:offset + value.numel()].view(value.shape)
            start, end = _row_range(value.shape[0], self.rank, self.world_size)
            local = value.to_local().detach()
            if local.shape[0] != end - start:  # a layout this path does not know: refuse
                raise RuntimeError(f"{name}: local shard has {local.shape[0]} rows, "
                                   f"expected {end - start}")
            full[start:end].copy_(local)  # the cast happens in this copy
            views.append((name, full))
            offset += value.numel()
        dist.barrier(group=self.group)  # every shard written
        out = [(name, full.clone()) for name, full in views]
        dist.barrier(group=self.group)  # every rank has read: the buffer may be rewritten
        return out
