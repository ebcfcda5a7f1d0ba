"""Inference engines: servers speaking SGLang's HTTP contract, their Ray actors, the router.

- ``EngineGroup`` (group.py): N engine actors + the sglang-router; what the trainer and
  rollout manager use.
- ``EngineServer`` / ``remote_actor_class()`` (actor.py): one supervised server process;
  ``HFLaunch`` (CPU, rollout/engines/hf) and ``SGLangLaunch`` (GPU) say how to start it.
- ``Router`` (router.py): the real ``sglang_router.launch_router`` process.
- ``MultiprocessingSerializer``, ``init_custom_process_group``, ``checksum``
  (weights_io.py): the trainer side of weight updates.

Submodules import lazily-heavy things (torch, ray) only where needed.
"""

from rollout.engines.actor import (EngineError, EngineServer, HFLaunch, LaunchSpec, SGLangLaunch,
                                   free_port, remote_actor_class, spec_from_config)
from rollout.engines.group import EngineGroup
from rollout.engines.router import Router
from rollout.engines.weights_io import (MultiprocessingSerializer, checksum,
                                        init_custom_process_group)

__all__ = ["EngineGroup", "EngineServer", "EngineError", "LaunchSpec", "HFLaunch", "SGLangLaunch",
           "Router", "free_port", "remote_actor_class", "spec_from_config",
           "MultiprocessingSerializer", "checksum", "init_custom_process_group"]
