"""The API dialects an agent may speak, each converted to and from the chat completion
that the session renders and records (one module per dialect):

- ``chat``: OpenAI chat completions (``/v1/chat/completions``), the session's own format;
- ``responses``: OpenAI's Responses API (``/v1/responses``);
- ``messages``: Anthropic's Messages API (``/v1/messages``).

A dialect module has ``ROUTES`` (paths under a session's base), ``to_chat(body)`` (its
request as a chat-completions request), ``from_chat(completion, body)`` (the chat
completion as its answer), ``stream(answer, body)`` (that answer as server-sent events,
for ``stream: true``) and ``error_body(RequestError)``. ``respond`` serves one request of
any dialect over a chat-completion function, for the session server and ``trainer.serve``
alike. The whole answer is computed before the first event is written (the engines return
whole completions), so an error is still a plain HTTP status the clients raise.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Awaitable, Callable

from aiohttp import web

from rollout.agent.dialects import chat, messages, responses
from rollout.agent.dialects.base import RequestError

DIALECTS: dict[str, ModuleType] = {"chat": chat, "responses": responses, "messages": messages}
ROUTES: dict[str, ModuleType] = {route: d for d in DIALECTS.values() for route in d.ROUTES}

__all__ = ["DIALECTS", "ROUTES", "RequestError", "error_response", "read_body", "respond"]


def error_response(dialect: ModuleType, error: RequestError) -> web.Response:
    return web.json_response(dialect.error_body(error), status=error.status)


async def read_body(request: web.Request) -> dict:
    """The request's JSON object (``RequestError`` 400 otherwise)."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", "invalid_json")
    return body


async def respond(request: web.Request, *, dialect: ModuleType,
                  complete: Callable[[dict], Awaitable[dict]]) -> web.StreamResponse:
    """Serve ``request`` in ``dialect``; ``complete(chat_body) -> chat.completion`` answers
    the converted request (raising ``RequestError`` for the client's mistakes)."""
    try:
        body = await read_body(request)
        answer = dialect.from_chat(await complete(dialect.to_chat(body)), body)
    except RequestError as e:
        return error_response(dialect, e)
    if not body.get("stream"):
        return web.json_response(answer)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                      "Cache-Control": "no-cache"})
    await out.prepare(request)
    for event in dialect.stream(answer, body):
        await out.write(event)
    await out.write_eof()
    return out
