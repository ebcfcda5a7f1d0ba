"""Inference engines: servers speaking SGLang's HTTP contract, their Ray actors, the router.

- ``EngineGroup`` (group.py): N engine actors + the sglang-router; what the trainer and
  rollout manager use.
- ``EngineServer`` / ``remote_actor_class()`` (actor.py): one supervised server process;
  ``HFLaunch`` (CPU, rollout/engines/hf) and ``SGLangLaunch`` (the real SGLang server, GPU
  or CPU) say how to start it.
- ``EngineClient`` (client.py): SGLang's admin routes for one engine, the supported SGLang
  versions, and ``EngineError``, the one error type of every engine call.
- ``Router`` (router.py): the real ``sglang_router.launch_router`` process.
- ``serialize_for_sglang``, ``init_custom_process_group`` (weights_io.py): weight payloads
  in SGLang's format, and the broadcast group of the distributed weight path.

Submodules import lazily-heavy things (torch, ray) only where needed.
"""

from rollout.engines.actor import (EngineServer, HFLaunch, LaunchSpec, SGLangLaunch, free_port,
                                   remote_actor_class, launch_spec)
from rollout.engines.client import (PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS,
                                    EngineClient, EngineError, UnsupportedEngineVersion)
from rollout.engines.group import EngineGroup, EngineTarget
from rollout.engines.router import Router

# weights_io imports torch; the processes that only supervise an engine or speak HTTP to one
# (every engine actor, the rollout manager) import this package and need none of it.
_WEIGHTS_IO = ("MultiprocessingSerializer", "init_custom_process_group", "serialize_for_sglang")


def __getattr__(name: str):
    if name in _WEIGHTS_IO:
        from rollout.engines import weights_io

        return getattr(weights_io, name)
    raise AttributeError(f"module 'rollout.engines' has no attribute {name!r}")


__all__ = ["EngineGroup", "EngineTarget", "EngineServer", "EngineClient", "EngineError",
           "UnsupportedEngineVersion", "PINNED_SGLANG_VERSION", "SUPPORTED_SGLANG_VERSIONS",
           "LaunchSpec", "HFLaunch", "SGLangLaunch", "Router", "free_port", "remote_actor_class",
           "launch_spec", "MultiprocessingSerializer", "init_custom_process_group",
           "serialize_for_sglang"]
