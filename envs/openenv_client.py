"""A running OpenEnv server as a multi-turn environment.

    python -m trainer.main env=openenv env.url=http://127.0.0.1:8000

An episode is one session on the server's ``/ws`` WebSocket (OpenEnv's own protocol:
``reset``, ``step``, ``close`` messages, each answered with an observation or an error):
the server gives every connection its own environment instance, so concurrent episodes
keep isolated state. (Plain HTTP ``/reset`` and ``/step`` build a fresh environment per
request: no episode can span them.) The server must allow as many concurrent sessions as
episodes run at once (``create_app(..., max_concurrent_envs=N)``); an episode that finds it
full waits for a free session.

Text in, text out: the model's reply goes into the action's one string field (or
``env.kwargs.action_field``, checked against the server's ``/schema``); the observation
shown to the model is its one string field (or ``env.kwargs.observation_field``), else the
observation as JSON. Numeric and boolean observation fields land in the sample's metadata
(an observation field ``success`` becomes ``rollout/success_rate``); the reward is the sum
of the server's step rewards. A row is a reset seed, passed as ``reset(seed=...)``: every
sample of a group starts the same episode, and the train and eval splits use different
seeds (the server decides what a seed means).

The client is written on ``websockets`` rather than imported from openenv-core: importing
``openenv.core``'s client imports its server stack and gradio, a start-up cost every
rollout process would pay (docs/environments.md). The tests run it against a real
openenv-core server. Needs the ``openenv`` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

from envs.base import Environment, EnvSetupError, StepResult, register, require, seed_rows

logger = logging.getLogger(__name__)

EXTRA = "openenv"
_ACTION_FIELDS: dict[tuple[str, Optional[str]], str] = {}  # (url, action_field) -> field
_CLOSE_TIMEOUT_S = 5.0


class OpenEnvError(RuntimeError):
    """An error message from the server (``{"type": "error", "data": {code, message}}``)."""

    def __init__(self, data: dict) -> None:
        self.code = str(data.get("code", "UNKNOWN"))
        super().__init__(f"OpenEnv server error {self.code}: {data.get('message', data)}")


def _websockets() -> Any:
    require("websockets", package="websockets (with openenv-core)", extra=EXTRA)
    from websockets.asyncio.client import connect

    return connect


def ws_url(url: str) -> str:
    """``http(s)://host:port`` (or ``ws(s)://``) -> the server's session endpoint."""
    base = url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(http):
            base = ws + base[len(http):]
    if not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base + "/ws"


def action_field_of(schema: dict, wanted: Optional[str]) -> str:
    """The action field the model's text goes into, from the server's action schema;
    an EnvSetupError naming env.kwargs.action_field when it cannot be told."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    described = ", ".join(f"{k} ({v.get('type', '?')})" for k, v in props.items()) or "none"
    if wanted is not None:
        if wanted not in props:
            raise EnvSetupError(f"env.kwargs.action_field: {wanted!r} is not a field of the "
                                f"server's action (fields: {described})")
        return wanted
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) != 1:
        raise EnvSetupError(f"env.kwargs.action_field: the server's action has fields "
                            f"{described}; name the string field the model's text goes into")
    return strings[0]


def _get_json(url: str, timeout_s: float) -> Any:
    import requests

    response = requests.get(url, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


@register("openenv")
class OpenEnvSession(Environment):
    """One session on an OpenEnv server per episode."""

    def __init__(self, max_turns: int = 1, seed: Optional[int] = None, url: Optional[str] = None,
                 action_field: Optional[str] = None, observation_field: Optional[str] = None,
                 train_size: int = 1000, eval_size: int = 100, message_timeout_s: float = 60.0
                 ) -> None:
        super().__init__(max_turns=max_turns, seed=seed)
        self.connect = _websockets()
        if not url:
            raise EnvSetupError("env.url: must be the OpenEnv server's address, e.g. "
                                "env=openenv env.url=http://127.0.0.1:8000")
        self.url, self.action_field = url.rstrip("/"), action_field
        self.observation_field = observation_field
        self.message_timeout_s = message_timeout_s
        self.ws: Any = None

    @classmethod
    def check_setup(cls, url: Optional[str] = None, action_field: Optional[str] = None,
                    **_: Any) -> None:
        _websockets()
        if not url:
            raise EnvSetupError("env.url: must be the OpenEnv server's address, e.g. "
                                "env=openenv env.url=http://127.0.0.1:8000")
        base = url.rstrip("/")
        try:
            _get_json(f"{base}/health", 10.0)
            schema = _get_json(f"{base}/schema", 10.0)
        except Exception as err:
            raise EnvSetupError(f"env.url: no OpenEnv server answers at {url} "
                                f"({type(err).__name__}: {' '.join(str(err).split())[:160]}); "
                                "start it first or fix env.url") from err
        action_field_of(schema.get("action") or {}, action_field)

    @classmethod
    def dataset(cls, split: str, train_size: int = 1000, eval_size: int = 100, **_: Any
                ) -> list[dict]:
        return seed_rows(split, train_size, eval_size)

    # ---- the session ------------------------------------------------------------------
    async def _field(self) -> str:
        key = (self.url, self.action_field)
        if key not in _ACTION_FIELDS:
            import aiohttp

            async with aiohttp.ClientSession() as http:
                async with http.get(f"{self.url}/schema") as response:
                    response.raise_for_status()
                    schema = await response.json()
            _ACTION_FIELDS[key] = action_field_of(schema.get("action") or {}, self.action_field)
        return _ACTION_FIELDS[key]

    async def _call(self, message: dict) -> dict:
        await self.ws.send(json.dumps(message))
        reply = json.loads(await asyncio.wait_for(self.ws.recv(), self.message_timeout_s))
        if reply.get("type") == "error":
            raise OpenEnvError(reply.get("data") or {})
        return reply.get("data") or {}

    async def _open(self, seed: int) -> dict:
        """Connect and reset; a server at capacity is retried until a session frees (the
        sample's own timeout bounds the wait)."""
        delay = 0.05
        while True:
            self.ws = await self.connect(ws_url(self.url), open_timeout=self.message_timeout_s,
                                         max_size=None)
            try:
                return await self._call({"type": "reset", "data": {"seed": seed}})
            except OpenEnvError as err:
                await self.close()
                if err.code != "CAPACITY_REACHED":
                    raise
                logger.info("OpenEnv server %s is at capacity; waiting %.2fs", self.url, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _render(self, observation: dict) -> str:
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise ValueError(f"env.kwargs.observation_field: {self.observation_field!r} "
                                 f"is not in the observation (fields: {sorted(observation)})")
            return str(observation[self.observation_field])
        strings = [v for v in observation.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
        return json.dumps(observation, sort_keys=True)

    @staticmethod
    def _info(observation: dict) -> dict:
        return {k: v for k, v in observation.items()
                if isinstance(v, (bool, int, float)) and k not in ("done", "reward")}

    async def reset(self, sample: Any) -> str:
        label = getattr(sample, "label", sample)
        if isinstance(label, str):
            label = json.loads(label)
        if not (isinstance(label, dict) and "seed" in label):
            raise ValueError(f"openenv: label must hold the reset seed ({{seed}}), got {label!r}")
        self.field = await self._field()
        data = await self._open(int(label["seed"]))
        return self._render(data.get("observation") or {})

    async def step(self, action_text: str) -> StepResult:
        data = await self._call({"type": "step", "data": {self.field: action_text}})
        observation = data.get("observation") or {}
        done = bool(data.get("done"))
        if done:
            await self.close()
        return (self._render(observation), float(data.get("reward") or 0.0), done,
                self._info(observation))

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is None:
            return
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                try:
                    # The server ends the session and closes the connection itself;
                    # closing first would make it fail closing an already closed socket.
                    await ws.send(json.dumps({"type": "close"}))
                    await ws.wait_closed()
                finally:
                    await ws.close()
        except Exception as err:  # the server may already be gone: nothing to release
            logger.debug("closing an OpenEnv session on %s: %s", self.url, err)
