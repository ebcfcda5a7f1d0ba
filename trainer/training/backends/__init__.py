"""Training backends, by ``train.backend`` name (trainer/training/backends/base.py: the protocol).

Each entry is imported only when chosen: Megatron pulls in megatron-core, FSDP does not.
"""

from __future__ import annotations

import importlib

from config import Backend, choices

BACKENDS: dict[Backend, str] = {
    "fsdp": "trainer.training.backends.fsdp:FSDPBackend",
    "megatron": "trainer.training.backends.megatron.backend:MegatronBackend",
}
assert tuple(BACKENDS) == choices(Backend)


def make_backend(name: Backend):
    """A new, uninitialised backend instance (``TrainBackend``) for ``train.backend``."""
    if name not in BACKENDS:
        raise ValueError(f"train.backend: must be one of {', '.join(BACKENDS)} (got {name!r})")
    module_name, _, cls_name = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"train.backend={name} is not available in this build: {e}") from e
    return getattr(module, cls_name)()
