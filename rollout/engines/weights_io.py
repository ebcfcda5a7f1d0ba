"""Weight-transfer helpers shared by the trainer side and the engines.

- ``MultiprocessingSerializer`` mirrors SGLang's (sglang.srt.utils): torch's ForkingPickler
  plus base64, so the JSON body of ``/update_weights_from_tensor`` carries handles, not
  bytes. On CPU the tensors' storage goes to /dev/shm under the 'file_system' sharing
  strategy, which unrelated processes (trainer actor -> engine server) can open; the
  default 'file_descriptor' strategy only works between a parent and its children.
- ``init_custom_process_group`` mirrors SGLang's helper: a process group that is *not*
  the default group, so a trainer whose default group is its training ranks can also join
  an (trainer rank 0 + engines) broadcast group.
- ``broadcast_bucket`` / ``broadcast_bucket_views``: a bucket as one broadcast for
  ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``, in the
  layout SGLang's receiver builds from the request's names, dtypes and shapes.
- ``serialize_for_sglang`` builds the body fields of SGLang's ``/update_weights_from_tensor``
  exactly as SGLang 0.5.x reads them (one payload per engine TP rank; a list of (name,
  tensor) or a flattened bucket), and ``deserialize_named_tensors`` is the matching reader
  (homegym's engines, tests, the GPU smoke's receiver).

SGLang payload format (read from sglang 0.5.18, not imported: homegym runs without it):

- ``TpModelWorker._deserialize_own_rank`` (managers/tp_worker.py:199-206) calls
  ``monkey_patch_torch_reductions()`` and then ``MultiprocessingSerializer.deserialize(
  serialized_named_tensors[tp_rank])``, which unpickles with ``SafeUnpickler``
  (utils/common.py:2963-3035): only globals under builtins., collections., copyreg.,
  functools., types., torch., multiprocessing.reduction., sglang.srt.* ... load. A
  homegym class in the pickle would be refused, and SGLang's own ``FlattenedTensorBucket``/
  ``FlattenedTensorMetadata`` cannot be pickled by a sender that does not have sglang.
- ``load_format="flattened_bucket"`` (model_executor/model_runner_components/
  weight_updater.py:319-335, 355-381) reads the unpickled object as a dict:
  ``d["flattened_tensor"]`` and ``d["metadata"]``, each metadata entry only through the
  attributes ``.name .shape .dtype .start_idx .end_idx .numel`` (it copies them into its own
  ``FlattenedTensorMetadata``), then ``flat[start:end].view(dtype).reshape(shape)``
  (weight_sync/tensor_bucket.py:90-107). So homegym writes that dict with
  ``types.SimpleNamespace`` metadata: every global in the pickle is builtins/types/torch,
  all on SafeUnpickler's allowlist, and no sglang class is needed on either side.
- ``load_format=None``: a plain list of (name, tensor) (weight_updater.py:337-350; the
  HTTP body carries the payloads as base64 strings, managers/io_struct.py:1798-1806).
- CUDA tensors: SGLang's ``monkey_patch_torch_reductions`` (utils/patch_torch.py:41-103)
  rewrites argument 6 of ``rebuild_cuda_tensor`` (the storage's device index) into the
  device UUID on the sender, and back to the receiver's local index (whatever its
  CUDA_VISIBLE_DEVICES) on the receiver. homegym does the sender half per pickler (its
  own dispatch table, no process-wide patch), and keeps the rebuild function pickled as
  ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which the SGLang receiver has
  patched to accept a UUID; ``install_cuda_uuid_rebuild`` is the receiver half for
  homegym's own receivers.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing.reductions  # noqa: F401  (registers torch reducers on ForkingPickler)


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        """ForkingPickler bytes (base64 text with ``output_str``). CPU tensors: shared
        memory files under /dev/shm. CUDA tensors: IPC handles that name the device by UUID
        (as SGLang's patched reductions do), so a receiver with another device numbering
        opens the right GPU."""
        if mp.get_sharing_strategy() != "file_system":
            mp.set_sharing_strategy("file_system")
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        _use_device_uuids(pickler)
        pickler.dump(obj)
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


# ----------------------------------------------------------------- CUDA IPC by device UUID
# rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device,
# handle, ...): the storage's device is argument 6 (unchanged for years; SGLang relies on
# the same constant, utils/patch_torch.py:64).
_DEVICE_ARG = 6


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_from_uuid(device) -> int:
    """A device index, or the UUID of a visible device -> its local index."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if _device_uuid(index) == device:
                return index
        raise RuntimeError(f"CUDA IPC handle names device {device!r}, which is not visible "
                           f"in this process (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    raise TypeError(f"unexpected CUDA IPC device {device!r}")


def _tensor_reducers() -> list:
    from torch.nn.parameter import Parameter

    return [torch.Tensor, Parameter, *getattr(torch, "_tensor_classes", ())]


def _use_device_uuids(pickler) -> None:
    """Make this pickler (only) write CUDA IPC handles with the device UUID. CPU tensors
    reduce exactly as before; the rebuild function stays torch's public name."""
    from torch.multiprocessing import reductions

    table = pickler.dispatch_table
    for cls in _tensor_reducers():
        reduce = table.get(cls)
        if reduce is None or getattr(reduce, "_homegym_uuid", False):
            continue

        def with_uuid(tensor, _reduce=reduce):
            fn, args = _reduce(tensor)
            if (tensor.device.type == "cuda" and len(args) > _DEVICE_ARG
                    and isinstance(args[_DEVICE_ARG], int)
                    and getattr(fn, "__name__", "") in ("rebuild_cuda_tensor",
                                                        "_rebuild_cuda_tensor_modified")):
                args = (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]),
                        *args[_DEVICE_ARG + 1:])
                # Pickle the rebuild function under torch's name, whatever this process
                # has patched it to: the receiver's (patched) function is looked up there.
                fn = reductions.rebuild_cuda_tensor
            return fn, args

        with_uuid._homegym_uuid = True
        table[cls] = with_uuid


def install_cuda_uuid_rebuild() -> None:
    """Receiver half (what SGLang's ``monkey_patch_torch_reductions`` does on its side):
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` accepts a device UUID in
    place of the index. Idempotent; harmless for int devices. The replacement keeps torch's
    module and name, so a process that patched itself still pickles references SGLang's
    SafeUnpickler accepts."""
    from torch.multiprocessing import reductions

    current = reductions.rebuild_cuda_tensor
    if (getattr(current, "_homegym_uuid", False)
            or hasattr(reductions, "_rebuild_cuda_tensor_original")):
        return  # ours, or SGLang's patch (which maps UUIDs too)

    def rebuild_cuda_tensor(*args):
        args = (*args[:_DEVICE_ARG], _device_from_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
        return current(*args)

    rebuild_cuda_tensor.__module__ = current.__module__
    rebuild_cuda_tensor.__qualname__ = current.__qualname__
    rebuild_cuda_tensor._homegym_uuid = True
    rebuild_cuda_tensor._homegym_original = current
    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor


# ----------------------------------------------------------------- SGLang's payload
FLATTENED_BUCKET = "flattened_bucket"
# Each tensor starts on a 16-byte boundary of the flat tensor (the largest itemsize).
# SGLang's own writer packs back to back, so a bool or odd-length bf16 tensor followed by
# a float32 one makes its reader's view() fail; its reader only uses start_idx/end_idx,
# so padding between tensors is read correctly.
_ALIGN = 16


def flatten_bucket(named_tensors) -> dict:
    """SGLang's flattened-bucket layout (weight_sync/tensor_bucket.py): every tensor's bytes
    concatenated into one uint8 tensor (dtypes may differ), plus per-tensor metadata with
    the attributes SGLang's reader uses (each tensor 16-byte aligned). An empty bucket is
    an empty tensor and no metadata (SGLang reconstructs nothing from it)."""
    named_tensors = list(named_tensors)
    if not named_tensors:
        return {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    flats, metadata, start = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        pad = -start % _ALIGN
        if pad:  # the reader's flat[start:end].view(dtype) needs start % itemsize == 0
            flats.append(flat.new_zeros(pad))
            start += pad
        metadata.append(SimpleNamespace(name=str(name), shape=torch.Size(tensor.shape),
                                        dtype=tensor.dtype, start_idx=start,
                                        end_idx=start + flat.numel(), numel=flat.numel()))
        flats.append(flat)
        start += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}


class SharedStaging:
    """Flattened buckets whose flat tensor lives in /dev/shm once and is reused.

    Serializing a fresh CPU tensor moves its storage into shared memory, a page-faulting
    copy on every push; a bucket staged here is shared once, and later pushes of the same
    layout only copy their bytes into it. A push's engines have answered (and copied out)
    before the next push overwrites the buffers.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[tuple, dict]] = {}

    def clear(self) -> None:
        """Drop the buffers (their /dev/shm files go with the last reference)."""
        self._buckets.clear()

    def flatten(self, key: int, named_tensors) -> dict:
        named_tensors = list(named_tensors)
        layout = tuple((str(n), tuple(t.shape), t.dtype) for n, t in named_tensors)
        held = self._buckets.get(key)
        if held is None or held[0] != layout:
            bucket = flatten_bucket(named_tensors)
            bucket["flattened_tensor"].share_memory_()
            self._buckets[key] = (layout, bucket)
            return bucket
        bucket = held[1]
        flat = bucket["flattened_tensor"]
        for meta, (_, tensor) in zip(bucket["metadata"], named_tensors):
            flat[meta.start_idx:meta.end_idx].copy_(
                tensor.detach().reshape(-1).contiguous().view(torch.uint8))
        return bucket


def unflatten_bucket(bucket) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``flatten_bucket`` (also reads SGLang's own ``FlattenedTensorBucket``
    dicts): views into the flat tensor, no copies."""
    flat = bucket["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
            for m in bucket["metadata"]]


def broadcast_bucket(named_tensors) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """``(named_tensors in sending order, one flat uint8 tensor)`` for SGLang's
    ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``: one
    broadcast per bucket instead of one per tensor. The receiver
    (``_update_bucketed_weights_from_distributed``, weight_sync/tensor_bucket.py) lays the
    bucket out from the request's names, dtypes and shapes, bytes back to back with no
    padding, and views each slice as its dtype, so each tensor must start at a multiple of
    its itemsize (0.5.23 refuses one that does not): the widest dtypes go first, which
    keeps every offset aligned. A one-tensor bucket is sent as a view, without a copy."""
    ordered = sorted(((str(n), t.detach()) for n, t in named_tensors),
                     key=lambda nt: -nt[1].element_size())  # stable: same-width order kept
    flats = [t.reshape(-1).contiguous().view(torch.uint8) for _, t in ordered]
    if not flats:
        raise ValueError("an empty bucket has nothing to broadcast")
    return ordered, flats[0] if len(flats) == 1 else torch.cat(flats)


def broadcast_bucket_views(names, dtypes, shapes, device="cpu",
                           ) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The receiving side of ``broadcast_bucket``, as SGLang lays it out: ``(the uint8
    buffer to receive into, (name, view) per tensor)``. ValueError where a tensor would
    start off its itemsize or a shape has a negative dimension (SGLang 0.5.23's checks)."""
    spans, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        shape = torch.Size(shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} in the flattened bucket is not a "
                             f"multiple of {dtype}'s size")
        size = shape.numel() * dtype.itemsize
        spans.append((name, dtype, shape, offset, offset + size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    return flat, [(name, flat[a:b].view(dtype).reshape(shape))
                  for name, dtype, shape, a, b in spans]


def serialize_for_sglang(named_tensors, tp_size: int = 1, flattened: bool = False,
                         ) -> tuple[list[str], Optional[str]]:
    """``(serialized_named_tensors, load_format)`` for SGLang's ``/update_weights_from_tensor``.

    One base64 payload per engine TP rank, each pickled separately (SGLang: each rank
    deserializes only its own entry, CUDA IPC ref-counting is per pickle). ``flattened``:
    one flat tensor + metadata per payload, ``load_format="flattened_bucket"``; otherwise
    a list of (name, tensor), ``load_format=None``. CUDA tensors travel as IPC handles
    (by device UUID): keep ``named_tensors`` alive until the engine has answered. CPU
    tensors travel through /dev/shm (file_system strategy), as the hf engine expects.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1 (got {tp_size})")
    named_tensors = [(str(n), t.detach()) for n, t in named_tensors]
    obj = flatten_bucket(named_tensors) if flattened else named_tensors
    payloads = [MultiprocessingSerializer.serialize(obj, output_str=True) for _ in range(tp_size)]
    return payloads, (FLATTENED_BUCKET if flattened else None)


# What SGLang's SafeUnpickler admits that a tensor payload can need (utils/common.py:2964).
_SAFE_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "types.", "torch.",
                  "multiprocessing.reduction.", "multiprocessing.resource_sharer.")
_DENIED = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
           ("types", "CodeType"), ("types", "FunctionType")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _DENIED and (module + ".").startswith(_SAFE_PREFIXES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a weight payload")


def deserialize_named_tensors(payload, load_format: Optional[str] = None,
                              ) -> list[tuple[str, torch.Tensor]]:
    """Read one TP rank's payload as SGLang does: only torch/builtin globals are allowed
    (a payload SGLang would refuse fails here too), CUDA handles may name devices by UUID,
    and a ``flattened_bucket`` is unflattened into (name, tensor) views."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")
    install_cuda_uuid_rebuild()
    if isinstance(payload, str):
        payload = base64.b64decode(payload)
    obj = _RestrictedUnpickler(io.BytesIO(payload)).load()
    if load_format == FLATTENED_BUCKET:
        return unflatten_bucket(obj)
    if load_format not in (None, "direct", "default"):
        raise ValueError(f"load_format {load_format!r} is not a tensor payload format")
    return [(str(n), t) for n, t in obj]
