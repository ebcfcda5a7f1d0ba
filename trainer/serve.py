"""Serve a model or a checkpoint with an OpenAI-compatible ``/v1/chat/completions``.

    python -m trainer.serve checkpoint=outputs/<run>/checkpoints/latest
    python -m trainer.serve model.path=/models/Qwen3-4B +recipe=qwen_4b port=8000 host=0.0.0.0
    python -m trainer.serve checkpoint=... unauthenticated=true     # no API key (trusted nets)

Extra keys: ``checkpoint`` (a checkpoint dir with ``hf/``, an ``hf/`` dir, or a run dir:
its latest checkpoint), ``host`` (default 127.0.0.1), ``port`` (default 8000; 0 = free
port), ``unauthenticated`` (default false). Everything else is a Hydra override of the
training config (``rollout.num_engines=1``, ``+recipe=...``): the engines are the same ones
training uses (hf on CPU, SGLang on GPU), behind the real sglang-router.

Authentication. The sglang-router's ``--api-key`` only authenticates the router TO its
workers; it does not check clients. So homegym puts a small authenticating proxy (aiohttp)
at the public entry: the engines and the router bind ``cluster.host`` (loopback by default)
and only the proxy listens on ``host``. The proxy requires ``Authorization: Bearer <key>``
(constant-time compare) on every route except ``GET /health`` and forwards only
``/v1/chat/completions``, ``/v1/completions`` and ``/generate`` (no admin routes such as
weight updates); ``GET /v1/models`` is answered by the proxy. The key comes from
``Endpoint.launch(api_key=...)`` or ``$HOMEGYM_API_KEY``; otherwise one is generated and
printed once. It is never logged anywhere else.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

FORWARDED = ("/v1/chat/completions", "/v1/completions", "/generate")
OPEN = ("/health",)


class EndpointError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A servable HF directory for a checkpoint dir (``<ckpt>/hf``), an HF dir, a run dir
    (its latest checkpoint) or ``checkpoints/`` dir."""
    p = Path(path).expanduser()
    candidates = [p / "hf", p, p / "latest" / "hf", p / "checkpoints" / "latest" / "hf"]
    for c in candidates:
        if (c / "config.json").exists():
            return str(c.resolve())
    raise FileNotFoundError(
        f"checkpoint={path}: no Hugging Face checkpoint there (looked for config.json in "
        f"{', '.join(str(c) for c in candidates)}). Give a checkpoint directory "
        "(outputs/<run>/checkpoints/step_NNNNNN or .../latest), its hf/ subdirectory, or a run "
        "directory.")


def _model_overrides(model: Any, checkpoint: Any) -> tuple[list[str], dict]:
    """Hydra overrides + values for the model (an api.Model, a path string or None) and an
    optional checkpoint (which replaces the weights, keeping the family's settings)."""
    overrides: list[str] = []
    values: dict = {}
    if model is not None and hasattr(model, "overrides"):
        overrides += model.overrides()
        values = model.values()
    elif isinstance(model, (str, os.PathLike)):
        values = {"model": {"path": str(model)}}
    if checkpoint is not None:
        values = {"model": {"path": resolve_checkpoint(checkpoint)}}
    return overrides, values


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


class _AuthProxy:
    """The public entry: checks the API key, forwards an allow-list of routes to the router."""

    def __init__(self, router_url: str, api_key: Optional[str], host: str, port: int,
                 model_name: str) -> None:
        self.router_url, self.api_key = router_url, api_key
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
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return self._reply("missing or invalid API key: send 'Authorization: Bearer "
                                   "<key>'", 401, "authentication_error")
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
        if request.path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
            return self._reply("'messages' must be a list of {role, content} objects", 400)
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

        try:
            asyncio.run_coroutine_threadsafe(_close(), self.loop).result(10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)


class Endpoint:
    """An OpenAI-compatible endpoint for a model or checkpoint (engines + router + proxy).

    ``Endpoint.launch(model, checkpoint=None, unauthenticated=False)``; ``chat(messages,
    chat_template_kwargs=...)`` returns the assistant message dict; ``url``; ``api_key``
    (None when unauthenticated); ``wait_until_ready(timeout)``; ``shutdown()``; a context
    manager."""

    def __init__(self, config, engines, proxy: _AuthProxy, api_key: Optional[str],
                 started_ray: bool, model_name: str) -> None:
        self.config = config
        self._engines = engines
        self._proxy = proxy
        self._api_key = api_key
        self._started_ray = started_ray
        self.model_name = model_name
        host = proxy.host if proxy.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{proxy.port}"
        self._session = requests.Session()
        self.default_max_tokens = config.rollout.max_response_len

    @property
    def api_key(self) -> Optional[str]:
        return self._api_key

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    @classmethod
    def launch(cls, model: Any = None, checkpoint: Any = None, *, unauthenticated: bool = False,
               api_key: Optional[str] = None, host: str = "127.0.0.1", port: int = 0,
               num_engines: Optional[int] = None, recipe: Any = None,
               overrides: Sequence[str] = (), recreate_if_existing: bool = True,
               quiet: bool = False, own_ray: bool = False) -> "Endpoint":
        """Start engines for ``model`` (an api.Model, a path, or None = the config's model),
        optionally with ``checkpoint``'s weights, and the authenticating entry on host:port.
        ``recreate_if_existing`` is accepted for seed compatibility: every launch starts
        fresh processes. ``recipe`` (an api.Recipe) picks the engine settings (GPU recipes
        use SGLang). Ray: the current cluster, else a local one that stays up for the rest
        of the process (so training and further endpoints reuse it) unless ``own_ray``."""
        from rollout.engines.group import EngineGroup
        from trainer.compose import compose_config
        from trainer.runtime import connect_ray

        hydra_overrides, values = _model_overrides(model, checkpoint)
        if recipe is not None:
            hydra_overrides = recipe.hydra_overrides() + hydra_overrides
        hydra_overrides += list(overrides)
        if num_engines is not None:
            values.setdefault("rollout", {})["num_engines"] = int(num_engines)
        config = compose_config(hydra_overrides, values)

        key = choose_api_key(unauthenticated, api_key)
        started_ray = connect_ray(config) and own_ray
        engines = EngineGroup(config)
        model_name = str(checkpoint) if checkpoint is not None else config.model.path
        proxy = _AuthProxy(engines.router_url, key, host, port, model_name)
        try:
            proxy.start()
        except BaseException:
            engines.shutdown()
            raise
        ep = cls(config, engines, proxy, key, started_ray, model_name)
        if not quiet:
            print(f"homegym: serving {model_name} at {ep.url}/v1/chat/completions "
                  f"({'no API key' if key is None else 'API key required'})", flush=True)
        return ep

    def wait_until_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._session.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"endpoint {self.url} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def chat_completion(self, messages: list[dict], *, chat_template_kwargs: Optional[dict] = None,
                        max_tokens: Optional[int] = None, timeout: float = 600.0,
                        **params: Any) -> dict:
        """The full OpenAI response object."""
        body: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                "max_tokens": max_tokens or self.default_max_tokens}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        body.update({k: v for k, v in params.items() if v is not None})
        r = self._session.post(self.url + "/v1/chat/completions", json=body,
                               headers=self.headers, timeout=timeout)
        if r.status_code != 200:
            try:
                err = r.json().get("error")
                message = err.get("message") if isinstance(err, dict) else (err or r.text)
            except ValueError:
                message = r.text
            raise EndpointError(r.status_code, str(message))
        return r.json()

    def chat(self, messages: list[dict], chat_template_kwargs: Optional[dict] = None,
             **params: Any) -> dict:
        """The assistant message ``{"role": "assistant", "content": ...}`` (seed contract)."""
        out = self.chat_completion(messages, chat_template_kwargs=chat_template_kwargs, **params)
        return dict(out["choices"][0]["message"])

    def shutdown(self) -> None:
        import ray

        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.stop()
        engines, self._engines = self._engines, None
        if engines is not None:
            engines.shutdown()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:  # never shows the key
        return f"Endpoint(url={self.url!r}, model={self.model_name!r}, " \
               f"auth={'on' if self._api_key else 'off'})"


# ======================================================================= CLI
_TRUE = ("1", "true", "yes", "on")


def split_args(argv: Sequence[str], keys: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Pull ``key=value`` for our own keys out of argv; the rest are Hydra overrides."""
    own: dict[str, str] = {}
    rest: list[str] = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name in keys:
            own[name] = value
        else:
            rest.append(arg)
    return own, rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    from trainer.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    own, overrides = split_args(argv, ("checkpoint", "host", "port", "unauthenticated"))
    try:
        ep = Endpoint.launch(None, own.get("checkpoint"),
                             unauthenticated=own.get("unauthenticated", "false").lower() in _TRUE,
                             host=own.get("host", "127.0.0.1"), port=int(own.get("port", 8000)),
                             overrides=overrides, own_ray=True)
    except (ConfigError, FileNotFoundError) as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        return 2
    auth = '-H "Authorization: Bearer $HOMEGYM_API_KEY" ' if ep.api_key else ""
    print(f"homegym: try: curl {ep.url}/v1/chat/completions {auth}-H 'Content-Type: "
          "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        print("homegym: shutting down the endpoint", flush=True)
        ep.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
