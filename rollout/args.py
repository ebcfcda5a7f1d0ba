"""The ``args`` object user plug-ins receive, and loading plug-ins by dotted path.

slime-style code reads ``args.sglang_router_ip``, ``args.sglang_router_port`` and its own
keys from ``rollout.extra_config`` (``args.max_turns``). Besides those, ``args`` exposes the
config sections the rollout side runs on (``args.model``, ``args.rollout``, ``args.data``,
``args.env``) and a few slime names for the same values, so ported code finds what it
looks up.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable
from urllib.parse import urlparse

from rollout.plugins import load_object


class RolloutArgs:
    def __init__(self, router_url: str, *, model: Any, rollout: Any, data: Any,
                 env: Any) -> None:
        parsed = urlparse(router_url if "://" in router_url else f"http://{router_url}")
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"router url {router_url!r} needs a host and a port")
        r = rollout
        self.model, self.rollout, self.data, self.env = model, rollout, data, env
        self.router_url = f"http://{parsed.hostname}:{parsed.port}"
        self.sglang_router_ip = parsed.hostname
        self.sglang_router_port = parsed.port
        # slime's names for the same settings.
        self.hf_checkpoint = model.path
        self.rollout_batch_size = r.rollout_batch_size
        self.n_samples_per_prompt = r.n_samples_per_prompt
        self.rollout_max_response_len = r.max_response_len
        self.rollout_temperature = r.temperature
        self.rollout_top_p = r.top_p
        self.rollout_top_k = r.top_k
        self.apply_chat_template_kwargs = dict(data.apply_chat_template_kwargs)
        self.max_turns = env.max_turns  # extra_config may override below
        for key, value in dict(r.extra_config).items():
            if not key.isidentifier():
                raise ValueError(f"rollout.extra_config: key {key!r} is not a Python identifier"
                                 " (user code reads it as args.<key>)")
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"RolloutArgs(router={self.router_url}, model={self.model.path!r})"


def load_plugin(path: str, key: str) -> Callable[..., Any]:
    """A user function by dotted path; it must be ``async def`` (it runs on the event loop)."""
    fn = load_object(path, key)
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{key}: {path!r} must be an async function (async def)")
    return fn
