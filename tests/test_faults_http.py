"""HTTP failures of the router and the engines: what is retried, and the error otherwise.

A request is sent again only where that is safe (``rollout.engines.client.may_retry``): a
/generate on any 5xx (the sample just restarts), any request that no server acted on
(refused connection, 503). A weight update answered 500 is not repeated; its error names
the engine and the route.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch
from aiohttp import web

from rollout import http
from rollout.engines.client import EngineClient, EngineError
from rollout.http import close_session, post
from trainer.driver import components
from trainer.weight_sync.push import read_back


@contextlib.contextmanager
def flaky_server(failures: dict[str, tuple[int, int]]):
    """A real HTTP server on loopback: route -> (status, how many times) it answers with
    that status before answering 200; every hit is counted per route."""
    hits: dict[str, int] = {}
    ready = threading.Event()
    box: dict = {}

    async def handle(request: web.Request) -> web.Response:
        route = request.path
        hits[route] = hits.get(route, 0) + 1
        status, times = failures.get(route, (200, 0))
        if hits[route] <= times:
            return web.json_response({"error": {"message": f"injected {status}"}}, status=status)
        return web.json_response({"success": True, "text": "ok", "meta_info": {}})

    def serve() -> None:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        box["loop"], box["runner"] = loop, runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}", hits
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)


def test_post_retries_generate_on_5xx_and_names_engine_and_route_when_spent():
    failures = {"/generate": (503, 2), "/v1/chat/completions": (500, 100),
                "/update_weights_from_disk": (500, 100), "/init_weights_update_group": (503, 1), "/abort_request": (400, 100)}
    with flaky_server(failures) as (url, hits):
        async def go():
            before = http.RETRIES["requests"]
            out = await post(f"{url}/generate", {"input_ids": [1]})
            assert out["text"] == "ok" and hits["/generate"] == 3
            assert http.RETRIES["requests"] - before == 2
            # Retried until the attempts are spent, then an error naming where.
            with pytest.raises(EngineError) as err:
                await post(f"{url}/v1/chat/completions", {}, max_retries=2)
            assert hits["/v1/chat/completions"] == 3
            assert err.value.status == 500 and err.value.route == "/v1/chat/completions"
            assert err.value.engine == url.removeprefix("http://")
            assert "after 3 attempts" in str(err.value)
            # A client error is never repeated, idempotent or not.
            with pytest.raises(EngineError, match="HTTP 400"):
                await post(f"{url}/abort_request", {})
            assert hits["/abort_request"] == 1
            # Not idempotent: a 500 is not repeated (the server may have acted on it)...
            with pytest.raises(EngineError, match="/update_weights_from_disk.*HTTP 500"):
                await post(f"{url}/update_weights_from_disk", {"model_path": "x"})
            assert hits["/update_weights_from_disk"] == 1
            # ...a 503 is (the request was refused, not served).
            await post(f"{url}/init_weights_update_group", {})
            assert hits["/init_weights_update_group"] == 2
            # A named endpoint (the manager names its router) is named in the error.
            http.ENDPOINT_NAMES[url] = "router"
            try:
                with pytest.raises(EngineError, match=r"^router /v1/chat/completions: "):
                    await post(f"{url}/v1/chat/completions", {}, max_retries=0)
            finally:
                del http.ENDPOINT_NAMES[url]
            await close_session()
        asyncio.run(go())


def test_engine_client_retries_only_idempotent_admin_calls():
    failures = {"/pause_generation": (502, 2), "/update_weights_from_disk": (500, 100),
                "/model_info": (503, 1), "/release_memory_occupation": (504, 100)}
    with flaky_server(failures) as (url, hits):
        client = EngineClient(url, name="engine7")
        client.pause_generation()
        assert hits["/pause_generation"] == 3
        client.call("/model_info", method="GET")
        assert hits["/model_info"] == 2
        with pytest.raises(EngineError) as err:
            client.update_weights_from_disk("/nowhere", version=3)
        assert hits["/update_weights_from_disk"] == 1
        assert str(err.value).startswith("engine7 /update_weights_from_disk: HTTP 500")
        with pytest.raises(EngineError, match="engine7 /release_memory_occupation: HTTP 504"):
            client.release_memory()
        assert hits["/release_memory_occupation"] == 1
    # Nothing listens: a refused connection is retried, then named.
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"engine7 /update_weights_from_disk: unreachable .*"
                                          r"after 4 attempts"):
        client.update_weights_from_disk("/nowhere")
    assert time.monotonic() - t0 < 10


def test_read_back_from_a_server_that_cannot_report_weights_verifies_by_version_only():
    """SGLang answers /get_weights_by_name with HTTP 400 for model classes without it (Qwen3
    in 0.5.18). read_back asks for its names all at once: every one of those calls must read
    as "cannot report", not only the first to fail, and a server that answered once is
    trusted to answer again (its later error raises)."""
    checks = {name: torch.zeros(2, 3) for name in
              ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "x", "y")}
    with flaky_server({"/get_weights_by_name": (400, 10 ** 6)}) as (url, hits):
        client = EngineClient(url, name="engine0")
        assert read_back([client], checks, version=1) == 0
        assert 1 <= hits["/get_weights_by_name"] <= len(checks)
    with flaky_server({}) as (url, hits):
        client = EngineClient(url, name="engine0")
        assert client.get_weights_by_name("x") is not None
    with pytest.raises(EngineError, match="engine0 /get_weights_by_name: unreachable"):
        client.get_weights_by_name("x")


@pytest.mark.slow
def test_generate_through_router_rides_out_engines_answering_503(ray_local, tiny_model_path):
    """A real engine behind the real router answers /generate with 503 while its memory
    is released; ``post`` keeps retrying and succeeds once it is resumed and has weights
    again (the router's circuit breaker, opened by the 503s, closes within seconds)."""
    import os

    from safetensors.torch import load_file

    from conftest import push_tensors
    from rollout_engines import config

    group = components.engine_group(config(num_engines=1), model_path=tiny_model_path)
    try:
        group.release_memory()
        # ignore_eos: the random tiny model samples its eos within 2 tokens ~0.1% of the time.
        payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2,
                                                               "ignore_eos": True}}

        async def go():
            with pytest.raises(EngineError) as err:
                await post(f"{group.router_url}/generate", payload, max_retries=1)
            assert err.value.status == 503 and err.value.route == "/generate"
            before = http.RETRIES["requests"]
            task = asyncio.create_task(post(f"{group.router_url}/generate", payload,
                                            max_retries=20))
            deadline = time.monotonic() + 30
            while http.RETRIES["requests"] - before < 2:  # seen failing, and retrying
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            def back() -> None:
                group.resume_memory()
                weights = load_file(os.path.join(tiny_model_path, "model.safetensors"))
                push_tensors(group.clients[0], weights.items(), version="back")

            await asyncio.get_running_loop().run_in_executor(None, back)
            out = await task
            await close_session()
            return out
        out = asyncio.run(go())
        assert len(out["output_ids"]) == 2 and out["meta_info"]["weight_version"] == "back"
    finally:
        group.shutdown()
