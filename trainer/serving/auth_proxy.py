"""The endpoint's public entry: an authenticating proxy in front of the sglang-router.

The sglang-router's ``--api-key`` only authenticates the router TO its workers; it does not
check clients. So homegym puts a small authenticating proxy (aiohttp) at the public entry:
the engines and the router bind ``cluster.host`` (loopback by default) and only the proxy
listens on ``host``. The proxy requires the key (``Authorization: Bearer <key>``, or
Anthropic's ``x-api-key: <key>``; constant-time compare) on every route except
``GET /health``. It answers ``/v1/chat/completions`` (``stream`` too), ``/v1/responses``
and ``/v1/messages`` itself, rendering and parsing as the agent session does
(rollout/agent/serving.py) over the router's ``/generate``; it forwards only
``/v1/completions`` and ``/generate`` (no admin routes such as weight updates);
``GET /v1/models`` is answered by the proxy. The key comes from
``Endpoint.launch(api_key=...)`` or ``$HOMEGYM_API_KEY``; otherwise one is generated and
printed once. It is never logged anywhere else.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import os
import secrets
import threading
from typing import Optional

from rollout.agent.dialects import ROUTES as DIALECT_ROUTES
from rollout.agent.dialects import respond
from rollout.agent.serving import ChatService
from rollout.http import close_session

FORWARDED = ("/v1/completions", "/generate")
OPEN = ("/health",)


def choose_api_key(unauthenticated: bool, api_key: Optional[str] = None) -> Optional[str]:
    """None when unauthenticated; else the given key, ``$HOMEGYM_API_KEY``, or a new one
    (printed once: the only place a key is ever shown)."""
    if unauthenticated:
        return None
    key = api_key or os.environ.get("HOMEGYM_API_KEY") or None
    if key is None:
        key = "hg-" + secrets.token_urlsafe(32)
        print(f"homegym: generated API key (shown once, keep it): {key}", flush=True)
    return key


class AuthProxy:
    """The public entry: checks the API key, forwards an allow-list of routes to the router."""

    def __init__(self, router_url: str, api_key: Optional[str], host: str, port: int,
                 model_name: str, chat: ChatService) -> None:
        self.router_url, self.api_key, self.chat = router_url, api_key, chat
        self.host, self.port, self.model_name = host, port, model_name
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.runner = None
        self.session = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self, timeout: float = 30.0) -> int:
        self._thread = threading.Thread(target=self._main, name="homegym-endpoint-proxy",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("endpoint proxy did not start")
        if self._error is not None:
            raise self._error
        return self.port

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as err:
            self._error = err
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        @web.middleware
        async def middleware(request, handler):
            return await self._middleware_impl(request, handler)

        app = web.Application(middlewares=[middleware], client_max_size=16 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        for route in FORWARDED:
            app.router.add_post(route, self._forward)
        for route, dialect in DIALECT_ROUTES.items():
            app.router.add_post(route, functools.partial(respond, dialect=dialect,
                                                         complete=self.chat.complete))
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.runner = web.AppRunner(app, access_log=None)  # no request logs: no headers leak
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @staticmethod
    def _reply(message: str, status: int, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                                 status=status)

    async def _middleware_impl(self, request, handler):
        from aiohttp import web

        if self.api_key and request.path not in OPEN:
            given = request.headers.get("Authorization", "")
            bearer = hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())
            # The anthropic client sends its api_key as x-api-key.
            anthropic = hmac.compare_digest(request.headers.get("x-api-key", "").encode(),
                                            self.api_key.encode())
            if not (bearer or anthropic):
                return self._reply("missing or invalid API key: send 'Authorization: Bearer "
                                   "<key>' (or 'x-api-key: <key>')", 401, "authentication_error")
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 404:
                return self._reply(f"unknown route {request.method} {request.path}", 404)
            if exc.status == 405:
                return self._reply(f"method {request.method} not allowed for {request.path}", 405)
            return self._reply(exc.reason or "error", exc.status)

    async def _health(self, request):
        from aiohttp import web

        try:
            async with self.session.get(self.router_url + "/health") as r:
                ok = r.status == 200
        except Exception:
            ok = False
        return web.json_response({"status": "ok" if ok else "unavailable"},
                                 status=200 if ok else 503)

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "homegym"}]})

    async def _forward(self, request):
        from aiohttp import web

        raw = await request.read()
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._reply("request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return self._reply("request body must be a JSON object", 400)
        try:
            upstream = await self.session.post(self.router_url + request.path, data=raw,
                                               headers={"Content-Type": "application/json"})
        except Exception as err:
            return self._reply(f"model backend unavailable: {type(err).__name__}", 503,
                               "server_error")
        async with upstream:
            ctype = upstream.headers.get("Content-Type", "application/json")
            if body.get("stream") and "text/event-stream" in ctype:
                resp = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": ctype})
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            data = await upstream.read()
            return web.Response(body=data, status=upstream.status,
                                headers={"Content-Type": ctype})

    def stop(self) -> None:
        if self.loop is None or not self.loop.is_running():
            return

        async def _close():
            if self.runner is not None:
                await self.runner.cleanup()
            if self.session is not None:
                await self.session.close()
            await close_session()  # the chat service's requests to the router

        try:
            asyncio.run_coroutine_threadsafe(_close(), self.loop).result(10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)
