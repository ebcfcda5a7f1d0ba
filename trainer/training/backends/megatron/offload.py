"""Offload of everything a Megatron rank holds on its device, keeping every view valid.

Megatron's tensors alias each other: with the distributed optimizer every parameter is a
view into its DDP bucket's contiguous ``param_data``, every ``param.main_grad`` (and the
main parameters' ``.grad``) a view into ``grad_data``, and fp32 main-parameter shards
are views into ``param_data`` too (``optimizer/distrib_optimizer.py``, ``shard_fp32_groups``).
``module.to()`` or ``p.data = p.data.cpu()`` would re-point one alias and silently detach
the others. So the unit of offload here is the storage, as in megatron-core's own
``_ParamAndGradBuffer.offload_to_cpu`` / ``reload_from_cpu``
(``distributed/param_and_grad_buffer.py``): copy the storage's bytes to host memory,
``untyped_storage().resize_(0)`` (the device memory goes back to the allocator while
every tensor object, view and Python reference stays as it is), and on onload resize it
back and copy the bytes in. That module does it only for the DDP buffers and
``optimizer.offload_to_cpu`` re-points main params (wrong for the fp32 shards that are
views); this does it for every storage reachable from the roots it is given.

Gradient storages (DDP ``grad_data``, ``main_grad``, ``.grad``) are not copied: they
come back zeroed, as in megatron's ``restore_grad_buffers``; every step zeroes them first.

While offloaded, ``host_view`` gives a CPU tensor aliasing the host copy of any
offloaded tensor (weight export and checkpoint saving read through it).
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

log = logging.getLogger("homegym.megatron")

# Attribute names under which megatron / torch hold gradients (contents not preserved).
_GRAD_ATTRS = frozenset({"grad", "main_grad", "grad_data"})


def _walkable(obj) -> bool:
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith("megatron.") and hasattr(obj, "__dict__")


def reachable_tensors(roots: Iterable) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, reached_as_gradient) for every tensor reachable from ``roots`` through
    containers, the ``__dict__`` of modules / optimizers / megatron-core objects, tensor
    attributes (``param.main_grad``) and ``.grad``. A tensor may be yielded more than once."""
    seen: set[tuple[int, bool]] = set()
    stack = [(r, False) for r in roots]
    while stack:
        obj, as_grad = stack.pop()
        key = (id(obj), as_grad)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(obj, torch.Tensor):
            yield obj, as_grad
            if obj.is_leaf and obj.grad is not None:
                stack.append((obj.grad, True))
            for name, value in getattr(obj, "__dict__", {}).items():
                stack.append((value, as_grad or name in _GRAD_ATTRS))
        elif isinstance(obj, dict):  # optimizer.state is keyed by parameters
            for k, v in obj.items():
                stack.append((k, as_grad))
                stack.append((v, as_grad))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, as_grad) for v in obj)
        elif _walkable(obj):
            for name, value in vars(obj).items():
                stack.append((value, as_grad or name in _GRAD_ATTRS))


def _on(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index in (None, device.index)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffloader:
    """Moves the device storages of everything reachable from some roots to host memory
    (pinned when ``pin``) and back; see the module docstring."""

    def __init__(self, device: torch.device, *, pin: bool) -> None:
        self.device = torch.device(device)
        self.pin = pin
        self.offloaded = False
        # storage key -> [storage, nbytes, host copy or None (gradient: comes back zeroed)]
        self._entries: dict[int, list] = {}
        self._host: dict[int, torch.Tensor] = {}  # pinned copies, reused across cycles

    @staticmethod
    def key(t: torch.Tensor) -> int:
        """Identity of a tensor's storage (stable across ``resize_``)."""
        return t.untyped_storage()._cdata

    def device_storages(self, roots) -> dict[int, tuple[torch.UntypedStorage, bool]]:
        """key -> (storage, gradient-only) for the roots' non-empty device storages."""
        out: dict[int, list] = {}
        for t, as_grad in reachable_tensors(roots):
            if not _on(t, self.device) or t.layout != torch.strided:
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a storage-less tensor subclass
                continue
            if st.nbytes() == 0:
                continue
            entry = out.setdefault(self.key(t), [st, True])
            entry[1] = entry[1] and as_grad
        return {k: (st, g) for k, (st, g) in out.items()}

    def offload(self, roots) -> int:
        """Free the device storages reachable from ``roots``; returns the bytes freed."""
        if self.offloaded:
            return 0
        storages = self.device_storages(roots)
        fixed = {k: st.nbytes() for k, (st, _) in storages.items() if not st.resizable()}
        if fixed:  # not from torch's allocator (from_blob, DLPack): left where it is
            log.warning("offload: %d storage(s) (%.1f MiB) on %s are not resizable and stay "
                        "there", len(fixed), sum(fixed.values()) / 2**20, self.device)
        entries = {}
        for k, (st, grad_only) in storages.items():
            if k in fixed:
                continue
            n = st.nbytes()
            host = None
            if not grad_only:
                host = self._host.get(k)
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
                host.copy_(_bytes(st), non_blocking=self.pin)
            entries[k] = [st, n, host]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for st, _, _ in entries.values():
            st.resize_(0)
        self._entries = entries
        if self.pin:
            self._host = {k: h for k, (_, _, h) in entries.items() if h is not None}
        self.offloaded = True
        return sum(n for _, n, _ in entries.values())

    def onload(self) -> int:
        """Reallocate and refill every storage ``offload`` freed; returns the bytes."""
        if not self.offloaded:
            return 0
        total = 0
        for st, n, host in self._entries.values():
            st.resize_(n)
            if host is None:
                _bytes(st).zero_()
            else:
                _bytes(st).copy_(host, non_blocking=self.pin)
            total += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._entries = {}
        self.offloaded = False
        return total

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when it is resident; while offloaded, a CPU tensor aliasing the
        host copy of its bytes (same shape, strides and offset)."""
        if not self.offloaded:
            return t
        entry = self._entries.get(self.key(t))
        if entry is None:
            return t
        host = entry[2]
        if host is None:
            raise RuntimeError("offload: gradient storages are not kept while offloaded")
        return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(),
                                                  t.size(), t.stride())
