"""The per-episode OpenAI-compatible endpoint agents talk to.

One aiohttp server per process and event loop (``SessionServer.get()``), on 127.0.0.1,
serves every open session under its own base URL,
``http://127.0.0.1:<port>/sessions/<id>/v1``: ``POST /chat/completions`` and
``GET /models``. A request is rendered with the tokenizer's chat template (``messages``
and ``tools``), sent to the engines as ``input_ids`` through the episode's policy (an
``EnginePolicy`` behind the router -- the same request path, sampling params, seeds and
abort switch as every other generate path), and the engine's output ids, log-probs and
finish reason are recorded verbatim in the session's ``Trace``. The answer is an OpenAI
``chat.completion`` whose ``tool_calls`` are parsed from the model's ``<tool_call>`` blocks.

Sampling is the episode's: a request's ``max_tokens`` / ``max_completion_tokens`` can only
lower the per-call budget, and its temperature, top_p or seed are ignored (the policy being
trained is the distribution the run samples from). Errors are OpenAI-shaped JSON with the
status the ``openai`` client maps to its exceptions: 400 (bad request, context too long,
unsupported options), 404 (unknown or closed session), 502 (engine error), 503 (the step
aborted the request: the episode is continued or dropped by the rollout manager).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from rollout.agent.toolcalls import parse_tool_calls
from rollout.agent.trace import Call, Trace
from rollout.engines.client import EngineError

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
_UNSUPPORTED = {"n": lambda v: v not in (None, 1), "stream": bool,
                "logit_bias": bool, "tool_choice": lambda v: v not in (None, "auto")}


class _RequestError(Exception):
    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error"
           ) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


@dataclass
class Session:
    """One episode's endpoint: its policy, rendering settings and trace."""

    id: str
    policy: Any  # rollout.generate.Policy: async act(token_ids, max_new_tokens)
    tokenizer: Any
    max_new_tokens: int
    max_context_len: int
    chat_template_kwargs: dict = field(default_factory=dict)
    trace: Trace = field(default_factory=Trace)
    aborted: bool = False
    base_url: str = ""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def render(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
            **self.chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def complete(self, body: dict) -> dict:
        if self.aborted:
            raise _RequestError(503, "the episode was aborted", "aborted", "server_error")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise _RequestError(400, "'messages' must be a non-empty list of messages with "
                                "a 'role'", "invalid_messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _RequestError(400, "'tools' must be a list", "invalid_tools")
        for key, bad in _UNSUPPORTED.items():
            if bad(body.get(key)):
                raise _RequestError(400, f"{key}={body.get(key)!r} is not supported by "
                                    "homegym's rollout sessions", "unsupported_parameter")
        budget = self.max_new_tokens
        for key in ("max_completion_tokens", "max_tokens"):
            if body.get(key) is not None:
                if not isinstance(body[key], int) or body[key] < 1:
                    raise _RequestError(400, f"'{key}' must be a positive integer",
                                        "invalid_value")
                budget = min(budget, body[key])
        try:
            prompt_ids = self.render(messages, tools)
        except Exception as e:  # a template error on the agent's messages
            raise _RequestError(400, f"chat template failed on these messages: "
                                f"{type(e).__name__}: {e}", "invalid_messages") from e
        room = self.max_context_len - len(prompt_ids)
        if room <= 0:
            raise _RequestError(400, f"the prompt has {len(prompt_ids)} tokens; the model's "
                                f"context is {self.max_context_len}", "context_length_exceeded")
        budget = min(budget, room)
        # One call at a time per episode: the trace is a sequence.
        async with self._lock:
            observe = getattr(self.policy, "observe_request", None)
            if observe is not None:  # scripted players answer from the messages
                observe(messages, tools)
            try:
                output_ids, log_probs, finish = await self.policy.act(prompt_ids, budget)
            except EngineError as e:
                raise _RequestError(502, f"engine error: {e}", "engine_error",
                                    "server_error") from e
            if finish == "abort":
                self.aborted = True
                raise _RequestError(503, "the request was aborted (end of the rollout step "
                                    "or a weight update)", "aborted", "server_error")
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
            parsed = parse_tool_calls(text) if tools else None
            call = Call(prompt_ids=list(prompt_ids), output_ids=list(output_ids),
                        log_probs=list(log_probs), finish=finish,
                        weight_version=getattr(self.policy, "weight_version", None),
                        tool_calls=len(parsed.tool_calls) if parsed else 0,
                        malformed_tool_call=bool(parsed and parsed.malformed))
            self.trace.calls.append(call)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = "length" if finish == "length" else "stop"
        if parsed is not None and parsed.tool_calls:
            message["content"] = parsed.content
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
            reason = "tool_calls" if finish != "length" else reason
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": reason,
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
                      "total_tokens": len(prompt_ids) + len(output_ids)},
        }


class SessionServer:
    """The one aiohttp app serving every session of this process's event loop."""

    _servers: dict[int, "SessionServer"] = {}

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.url = ""
        self._runner: Optional[web.AppRunner] = None
        self._http = None  # httpx client shared by the episodes' openai clients
        self._started: Optional[asyncio.Future] = None

    @classmethod
    async def get(cls) -> "SessionServer":
        loop_id = id(asyncio.get_running_loop())
        server = cls._servers.get(loop_id)
        if server is None:
            server = cls._servers[loop_id] = cls()
            # Episodes start together: they all wait for the one start.
            server._started = asyncio.ensure_future(server._start())
        try:
            await asyncio.shield(server._started)
        except BaseException:
            if cls._servers.get(loop_id) is server and server._started.done():
                cls._servers.pop(loop_id, None)
            raise
        return server

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        self._servers.pop(id(asyncio.get_running_loop()), None)
        if self._http is not None:
            await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, **kwargs: Any) -> Session:
        sid = uuid.uuid4().hex
        session = Session(id=sid, **kwargs)
        session.base_url = f"{self.url}/sessions/{sid}/v1"
        self.sessions[sid] = session
        return session

    def close_session(self, session: Session) -> None:
        self.sessions.pop(session.id, None)

    def client(self, session: Session, *, timeout: float) -> Any:
        """An ``openai.AsyncOpenAI`` for ``session``. No retries: a 503 means the episode
        was aborted, and retrying would only re-send it; the manager decides."""
        import httpx
        import openai

        if self._http is None:
            # httpx logs every request at INFO: thousands of lines per step in the driver's
            # log. Left alone where someone configured that logger.
            httpx_logger = logging.getLogger("httpx")
            if httpx_logger.level == logging.NOTSET:
                httpx_logger.setLevel(logging.WARNING)
            self._http = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                timeout=None)
        return openai.AsyncOpenAI(base_url=session.base_url, api_key="homegym-session",
                                  max_retries=0, timeout=timeout, http_client=self._http)

    async def _models(self, request: web.Request) -> web.Response:
        if request.match_info["sid"] not in self.sessions:
            return _error(404, "unknown or closed session", "session_not_found")
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "homegym"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return _error(404, "unknown or closed session", "session_not_found")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json")
        try:
            return web.json_response(await session.complete(body))
        except _RequestError as e:
            return _error(e.status, e.message, e.code, e.kind)
