"""The per-episode endpoint agents talk to, in the API dialect they speak.

One aiohttp server per process and event loop (``SessionServer.get()``), on 127.0.0.1,
serves every open session under its own base URL,
``http://127.0.0.1:<port>/sessions/<id>/v1``: ``POST /chat/completions`` (``stream``
too), ``POST /responses`` (OpenAI's Responses API), ``POST /messages`` (Anthropic's
Messages API; the ``anthropic`` client appends ``/v1/messages`` to its base URL, so the
session's root and its ``/v1`` both work), ``GET /models``, and vLLM's token route
``POST /sessions/<id>/inference/v1/generate`` (token ids in and out, for clients that
render prompts themselves, such as verifiers' training client). Each dialect is converted
to and from a chat completion (rollout/agent/dialects/), so every call is rendered and
recorded the same way: the messages and tools rendered with the tokenizer's chat
template, sent to the engines as ``input_ids`` through the episode's policy (an
``EnginePolicy`` behind the router -- the same request path, sampling params, seeds and
abort switch as every other generate path), and the engine's output ids, log-probs and
finish reason recorded verbatim in the session's ``Trace``.

Tool calls are parsed from the model's text in the format its chat template writes
(rollout/agent/tool_formats.py: Qwen3's JSON or Qwen3.5's XML); a malformed one
reaches the agent as a call it can answer with a tool error (its arguments the model's
raw text) and is counted. An assistant message this session answered, sent back
unchanged in any dialect, is rendered as the model's own text, so a follow-up call
extends the recorded tokens exactly whatever the dialect re-serialised (Anthropic's
parsed ``input``, other JSON spacing, a malformed call).

Sampling is the episode's: a request's ``max_tokens`` / ``max_completion_tokens`` (or the
dialect's equivalent) can only lower the per-call budget, and its temperature, top_p or
seed are ignored (the policy being trained is the distribution the run samples from).
Errors have the status the clients map to their exceptions: 400 (bad request, context
too long, unsupported options), 404 (unknown or closed session), 502 (engine error), 503
(the step aborted the request: the episode is continued or dropped by the rollout
manager).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

from aiohttp import web

from rollout.agent.dialects import ROUTES, chat, error_response, read_body, respond
from rollout.agent.dialects.base import RequestError, new_id, text_of
from rollout.agent.tool_formats import ToolFormat, tool_format
from rollout.agent.trace import Call, Trace
from rollout.engines.client import EngineError

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"
_UNSUPPORTED = {"n": lambda v: v not in (None, 1), "logit_bias": bool,
                "tool_choice": lambda v: v not in (None, "auto")}
# Answers with tool calls remembered per session (an episode makes a few; trainer.serve
# shares one memory across requests).
MAX_ANSWERS = 4096


def _same_arguments(sent: Any, answered: str) -> bool:
    if sent == answered:
        return True
    try:
        value = json.loads(answered)
        return (sent if isinstance(sent, dict) else json.loads(sent)) == value
    except (TypeError, ValueError):
        return False


@dataclass
class _Answer:
    """An answer with tool calls as the agent got it, and the model's text behind it."""

    text: str
    content: Optional[str]
    calls: list[tuple[str, str, str]]  # (id, name, arguments)

    def echoed_by(self, message: dict) -> bool:
        calls = message.get("tool_calls")
        if not isinstance(calls, list) or len(calls) != len(self.calls):
            return False
        for call, (cid, name, arguments) in zip(calls, self.calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or call.get("id") != cid or fn.get("name") != name \
                    or not _same_arguments(fn.get("arguments"), arguments):
                return False
        try:
            return text_of(message.get("content"), "") == (self.content or "")
        except RequestError:
            return False


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
    answers: dict[str, _Answer] = field(default_factory=dict)  # by first tool call id
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def _as_generated(self, message: Any) -> Any:
        """An assistant message this session answered, sent back unchanged, as the model's
        own text (which the template renders verbatim)."""
        if not isinstance(message, dict) or message.get("role") != "assistant":
            return message
        calls = message.get("tool_calls")
        first = calls[0] if isinstance(calls, list) and calls else None
        answer = self.answers.get(first.get("id")) if isinstance(first, dict) else None
        if answer is not None and answer.echoed_by(message):
            return {"role": "assistant", "content": answer.text}
        return message

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        return tool_format(self.tokenizer)

    def render(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            self.tool_format.prepare([self._as_generated(m) for m in messages]),
            tools=tools or None, tokenize=False, add_generation_prompt=True,
            **self.chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _budget(self, limits: dict) -> int:
        budget = self.max_new_tokens
        for key, value in limits.items():
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise RequestError(400, f"'{key}' must be a positive integer",
                                       "invalid_value")
                budget = min(budget, value)
        return budget

    async def _act(self, prompt_ids: list[int], budget: int,
                   request: Optional[tuple[list, Optional[list]]] = None
                   ) -> tuple[list[int], list[float], str]:
        """One engine call for ``prompt_ids``; the caller records it (under the lock)."""
        if self.aborted:
            raise RequestError(503, "the episode was aborted", "aborted", "server_error")
        room = self.max_context_len - len(prompt_ids)
        if room <= 0:
            raise RequestError(400, f"the prompt has {len(prompt_ids)} tokens; the model's "
                               f"context is {self.max_context_len}", "context_length_exceeded")
        observe = getattr(self.policy, "observe_request", None)
        if observe is not None and request is not None:  # scripted players read messages
            observe(*request)
        try:
            output_ids, log_probs, finish = await self.policy.act(prompt_ids, min(budget, room))
        except EngineError as e:
            raise RequestError(502, f"engine error: {e}", "engine_error", "server_error") from e
        if finish == "abort":
            self.aborted = True
            raise RequestError(503, "the request was aborted (end of the rollout step or a "
                               "weight update)", "aborted", "server_error")
        return list(output_ids), list(log_probs), finish

    def _record(self, prompt_ids: list[int], output: tuple[list[int], list[float], str],
                tool_calls: int = 0, malformed: int = 0) -> None:
        self.trace.calls.append(Call(
            prompt_ids=list(prompt_ids), output_ids=output[0], log_probs=output[1],
            finish=output[2], weight_version=getattr(self.policy, "weight_version", None),
            tool_calls=tool_calls, malformed_tool_calls=malformed))

    def _remember(self, text: str, message: dict) -> None:
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in message["tool_calls"]]
        self.answers[calls[0][0]] = _Answer(text, message.get("content"), calls)
        while len(self.answers) > MAX_ANSWERS:
            self.answers.pop(next(iter(self.answers)))

    async def complete(self, body: dict) -> dict:
        """A chat-completions request -> the ``chat.completion`` (every dialect's core)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError(400, "'messages' must be a non-empty list of messages with "
                               "a 'role'", "invalid_messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError(400, "'tools' must be a list", "invalid_tools")
        for key, bad in _UNSUPPORTED.items():
            if bad(body.get(key)):
                raise RequestError(400, f"{key}={body.get(key)!r} is not supported by "
                                   "homegym's chat sessions", "unsupported_parameter")
        budget = self._budget({k: body.get(k) for k in ("max_completion_tokens", "max_tokens")})
        try:
            prompt_ids = self.render(messages, tools)
        except Exception as e:  # a template error on the agent's messages
            raise RequestError(400, f"chat template failed on these messages: "
                               f"{type(e).__name__}: {e}", "invalid_messages") from e
        # One call at a time per episode: the trace is a sequence.
        async with self._lock:
            output = await self._act(prompt_ids, budget, (messages, tools))
            output_ids, _, finish = output
            text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
            parsed = self.tool_format.parse(text, tools) if tools else None
            found = parsed.tool_calls if parsed else []
            calls = [c.to_openai() for c in found]
            self._record(prompt_ids, output, tool_calls=sum(c.error is None for c in found),
                         malformed=parsed.malformed if parsed else 0)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = "length" if finish == "length" else "stop"
        if calls:
            message.update(content=parsed.content, tool_calls=calls)
            self._remember(text, message)
            reason = "tool_calls" if finish != "length" else reason
        return {
            "id": new_id("chatcmpl"), "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": reason,
                         "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
                      "total_tokens": len(prompt_ids) + len(output_ids)},
        }

    async def generate(self, body: dict) -> dict:
        """vLLM's ``/inference/v1/generate``: the client's token ids in, the engine's output
        ids and log-probs out, recorded as they are (the client parses tool calls itself).
        Of its sampling params only ``max_tokens`` applies (lowering the budget)."""
        prompt_ids = body.get("token_ids")
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt_ids):
            raise RequestError(400, "'token_ids' must be a non-empty list of token ids",
                               "invalid_token_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError(400, "'sampling_params' must be an object", "invalid_value")
        budget = self._budget({"sampling_params.max_tokens": params.get("max_tokens")})
        async with self._lock:
            output = await self._act(prompt_ids, budget)
            self._record(prompt_ids, output)
        output_ids, log_probs, finish = output
        return {"request_id": new_id("gen"), "prompt_token_ids": list(prompt_ids),
                "choices": [{"index": 0, "token_ids": output_ids,
                             "finish_reason": "length" if finish == "length" else "stop",
                             "logprobs": {"content": [
                                 {"token": f"token_id:{t}", "logprob": lp}
                                 for t, lp in zip(output_ids, log_probs)]}}],
                "usage": {"prompt_tokens": len(prompt_ids),
                          "completion_tokens": len(output_ids),
                          "total_tokens": len(prompt_ids) + len(output_ids)}}


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
        for route, dialect in ROUTES.items():
            app.router.add_post("/sessions/{sid}" + route,
                                functools.partial(self._dialect, dialect))
        app.router.add_post("/sessions/{sid}/inference/v1/generate", self._generate)
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
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return error_response(chat, _gone())
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "homegym",
             "max_model_len": session.max_context_len}]})

    async def _dialect(self, dialect: ModuleType, request: web.Request) -> web.StreamResponse:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return error_response(dialect, _gone())
        return await respond(request, dialect=dialect, complete=session.complete)

    async def _generate(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["sid"])
        try:
            if session is None:
                raise _gone()
            return web.json_response(await session.generate(await read_body(request)))
        except RequestError as e:
            return error_response(chat, e)


def _gone() -> RequestError:
    return RequestError(404, "unknown or closed session", "session_not_found")
