"""The generation side: samples, data, engines' HTTP client, rollout manager.

User code written for slime ports by changing its imports to
``from rollout import GenerateState, post, Sample``.
"""

from rollout.lazy_exports import lazy_exports

# Loaded on first use: every engine server, engine actor and training rank imports a
# submodule of this package, and the generate machinery behind these names (aiohttp among
# it) would cost each of those processes ~0.3 CPU-s at start for nothing.
__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "rollout.generate": ("GenerateState",), "rollout.http": ("post", "generate_together"),
    "rollout.sample": ("Sample", "RolloutBatch")})
