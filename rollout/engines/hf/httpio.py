"""The HTTP pieces both of the CPU engine's processes use: SGLang's error bodies, JSON in
and out, and the middleware that checks the api key and turns errors into answers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import orjson
from aiohttp import web

log = logging.getLogger("homegym.hf_server")

# Routes that answer without the api key (SGLang leaves /health open for probes).
OPEN_ROUTES = {"/health"}
# The routes whose handler is cancelled when its client goes away, which aborts the
# request's rows, as SGLang aborts a disconnected client's request. Every other handler
# runs to its end (a weight update half-recorded helps no one).
CANCELLABLE_ROUTES = {"/generate", "/v1/chat/completions", "/v1/completions"}


class BadRequest(ValueError):
    """A client mistake: answered with HTTP 400 and this message."""


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            405: "MethodNotAllowed", 503: "ServiceUnavailable"}.get(status, "Error")
    return json_response({"error": {"message": message, "type": kind, "code": status},
                          "success": False, "message": message}, status)


async def read_body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def guard(api_key: Optional[str]):
    """The middleware of either process: the api key, then the handler (shielded from its
    client going away unless its route is cancellable), with client mistakes, unknown
    routes and bugs answered as SGLang's JSON errors."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if api_key and request.path not in OPEN_ROUTES:
            if request.headers.get("Authorization", "") != f"Bearer {api_key}":
                return error_response("missing or wrong api key (send 'Authorization: Bearer "
                                      "<key>')", 401)
        try:
            if request.path in CANCELLABLE_ROUTES:
                return await handler(request)
            return await asyncio.shield(handler(request))
        except BadRequest as exc:
            return error_response(str(exc), 400)
        except web.HTTPException as exc:  # unknown route / wrong method -> JSON, not HTML
            if exc.status == 404 and request.path in ("/get_weight_version", "/weight_version"):
                return error_response(f"Endpoint '{request.path}' is deprecated. Please use "
                                      "'/model_info' instead.", 404)
            if exc.status == 404:
                return error_response(f"unknown route {request.method} {request.path}", 404)
            return error_response(f"{exc.reason} for {request.method} {request.path}", exc.status)
        except Exception as exc:  # a bug must not take the server down
            log.exception("error in %s", request.path)
            return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    return middleware
