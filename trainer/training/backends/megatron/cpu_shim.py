"""torch.cuda shims that let megatron-core 0.16 run on CPU. FOR TESTING AND DEBUGGING ONLY.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:
``torch.cuda.current_device()`` as the device of new buffers (rope, DDP grad buffers,
optimizer state), the CUDA RNG state behind its RNG tracker, CUDA streams/events/
synchronize, ``device='cuda'`` tensor factories (grad scaler, grad clipping) and
``Tensor.type() == 'torch.cuda.FloatTensor'`` checks in the optimizer. ``apply()`` patches
exactly those, process-wide, so the unmodified megatron-core code runs on CPU tensors.

It is applied only by the Megatron backend and only when CUDA is absent
(``apply_if_needed``); a process with a GPU never sees it. Measured cost on the tiny model:
~10% (a global TorchFunctionMode redirect instead was 8x slower). Never use it for real
training: CPU Megatron exists so that the backend's code (TP/PP schedules, weight maps,
distributed optimizer) can be tested on any machine.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False
_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)
    return wrapper


class _FakeStream:
    """Stands in for torch.cuda.Stream/Event: everything runs synchronously on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _FakeStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_if_needed() -> bool:
    """Apply the shims when this process has no CUDA device; returns whether applied."""
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    apply()
    return True


def apply() -> None:
    """Patch torch.cuda / megatron-core for CPU execution (idempotent, process-wide)."""
    global _APPLIED
    if _APPLIED:
        return
    cuda = torch.cuda

    # 1. Device of new buffers: megatron passes torch.cuda.current_device() as `device=`
    #    or to `.to()`. Return the CPU device itself so both work.
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0

    # 2. Tensor factories called with device='cuda' (grad scaler, clip_grads, buffers).
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                 "zeros_like", "ones_like", "empty_like"):
        setattr(torch, name, _redirect_device(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self

    # 3. Type checks such as `param.type() == 'torch.cuda.FloatTensor'` in the optimizer.
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original_type(self, dtype, non_blocking, **kwargs)
    torch.Tensor.type = tensor_type

    # 4. Streams, events, synchronisation, memory queries.
    cuda.Stream = _FakeStream
    cuda.Event = _FakeStream
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0

    # 5. The CUDA RNG state behind megatron's RNG tracker: a separate CPU generator plays
    #    the GPU's generator (the CPU default generator stays untouched by forks).
    fake = torch.Generator()
    fake.manual_seed(0)

    def manual_seed(seed):
        fake.manual_seed(int(seed))

    cuda.manual_seed = manual_seed
    cuda.manual_seed_all = manual_seed
    cuda.get_rng_state = lambda *a, **k: fake.get_state()
    cuda.set_rng_state = lambda state, *a, **k: fake.set_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: fake.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: fake.set_state(state)
    _APPLIED = True
