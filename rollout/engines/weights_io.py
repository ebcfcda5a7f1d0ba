"""Weight-transfer helpers shared by the trainer side and the engines.

- ``MultiprocessingSerializer`` mirrors SGLang's (sglang.srt.utils): torch's ForkingPickler
  plus base64, so the JSON body of ``/update_weights_from_tensor`` carries handles, not
  bytes. On CPU the tensors' storage goes to /dev/shm under the 'file_system' sharing
  strategy, which unrelated processes (trainer actor -> engine server) can open; the
  default 'file_descriptor' strategy only works between a parent and its children.
- ``init_custom_process_group`` mirrors SGLang's helper: a process group that is *not*
  the default group, so a trainer whose default group is its training ranks can also join
  an (trainer rank 0 + engines) broadcast group.
- ``checksum`` is homegym's end-to-end check: float64 sum over all tensors.
"""

from __future__ import annotations

import base64
import io
import pickle
from datetime import timedelta
from typing import Iterable

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing.reductions  # noqa: F401  (registers torch reducers on ForkingPickler)


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    """Float64 sum over the values of all tensors (order-independent up to rounding)."""
    total = 0.0
    for t in tensors:
        total += float(t.detach().to(torch.float64).sum())
    return total


def checksums_match(expected: float, got: float) -> bool:
    # Sums over millions of values in different orders differ by rounding only.
    return abs(expected - got) <= 1e-6 * max(1.0, abs(expected), abs(got))


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        if mp.get_sharing_strategy() != "file_system":
            mp.set_sharing_strategy("file_system")
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        if output_str:
            return base64.b64encode(data).decode("utf-8")
        return data

    @staticmethod
    def deserialize(data):
        if mp.get_sharing_strategy() != "file_system":
            mp.set_sharing_strategy("file_system")
        if isinstance(data, str):
            data = base64.b64decode(data)
        return pickle.loads(data)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout_s: float = 600.0):
    """A process group next to (not replacing) the default one, as SGLang builds it."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
