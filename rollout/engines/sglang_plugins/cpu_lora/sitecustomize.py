"""A shim loaded *inside an SGLang server on CPU that serves LoRA adapters* (and nowhere else).

SGLang 0.5.18's LoRA layers and its torch_native LoRA backend allocate their host-side
index tensors with ``pin_memory=True`` (srt/lora/layers.py, lora/backend/torch_backend.py)
and pin adapter weights (lora/lora.py), unconditionally. Without an accelerator torch
refuses: "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no
pinned memory allocator is available on this system." and the scheduler dies at start-up.
Pinning only speeds up host-to-device copies, which a CPU server never makes, so here it
is a no-op: the ``pin_memory`` argument of torch's tensor factories is dropped and
``Tensor.pin_memory()`` returns the tensor.

Python imports this file at interpreter start-up because its directory is first on the
server's PYTHONPATH (rollout.engines.actor.SGLangLaunch puts it there for device=cpu with
lora_rank > 0; the scheduler processes SGLang spawns inherit the variable). It does
nothing where torch has an accelerator.
"""

import functools

import torch


def _without_pinning(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


if not torch.cuda.is_available():
    for _name in ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange",
                  "empty_like", "zeros_like", "ones_like", "full_like"):
        setattr(torch, _name, _without_pinning(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
