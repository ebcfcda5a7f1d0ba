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

from rollout.lazy_exports import lazy_exports

# Each name is loaded on first use. An engine server imports this package for its client's
# constants alone; the actor, group and router modules (requests, Ray's helpers) and
# weights_io (torch) would cost the processes that need none of them at start.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "rollout.engines.actor": ("EngineServer", "HFLaunch", "LaunchSpec", "SGLangLaunch",
                              "free_port", "remote_actor_class", "launch_spec"),
    "rollout.engines.client": ("PINNED_SGLANG_VERSION", "SUPPORTED_SGLANG_VERSIONS",
                               "EngineClient", "EngineError", "UnsupportedEngineVersion"),
    "rollout.engines.group": ("EngineGroup", "EngineTarget"),
    "rollout.engines.router": ("Router",),
    "rollout.engines.weights_io": ("MultiprocessingSerializer", "init_custom_process_group",
                                   "serialize_for_sglang"),
})
