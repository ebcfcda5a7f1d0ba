"""The CPU engine's HTTP front: the process that speaks HTTP to clients.

The engine is two processes. The scheduler process (server.py) owns the model, runs the
batcher's thread and serves the control routes (weights, flush, pause, info). This one,
forked from it at start-up, listens on the engine's port: it parses, validates and
tokenizes generation requests, hands each to the scheduler as one small frame over a
socket (channel.py), and formats SGLang's answers; every other route it passes to the
scheduler's control server as it came. Why two: in one process the HTTP thread's ~350 us
of Python per request took the GIL from the scheduler thread between torch ops, 750-950
times a multi-turn run (docs/performance.md, "Where the engine's time goes"). SGLang, too,
runs its HTTP server and tokenizer manager in a process apart from its scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import os
import signal
import socket
import time
import uuid
from types import SimpleNamespace
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

from rollout.engines.hf.channel import Channel
from rollout.engines.hf.httpio import BadRequest, guard, json_response, log, read_body

# The routes served here; every other one is the scheduler's (server.routes lists all).
GENERATION_HANDLERS = ("generate", "chat_completions", "completions")


async def _all(jobs: list) -> list:
    """``asyncio.gather`` of the jobs, but a lone one awaited in place: gather wraps each in
    a task, 17 us a request on this path (a generate request's HTTP work is ~350 us) for
    the usual n=1. A client that goes away cancels the lone job as it would a gathered one."""
    if len(jobs) == 1:
        return [await jobs[0]]
    return await asyncio.gather(*jobs)


def _num(params: dict, key: str, default, kind=float, lo=None, hi=None, lo_open=False):
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not float(value).is_integer()):
        raise BadRequest(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'} "
                         f"(got {value!r})")
    value = kind(value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadRequest(f"sampling_params.{key} must be {'>' if lo_open else '>='} {lo} (got {value})")
    if hi is not None and value > hi:
        raise BadRequest(f"sampling_params.{key} must be <= {hi} (got {value})")
    return value


def sampling(sp: Any) -> dict:
    """Validated sampling parameters, as JSON (the scheduler builds its Request from them)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    stop = sp.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("sampling_params.stop must be a string or a list of strings")
    stop_ids = sp.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
    top_k = _num(sp, "top_k", -1, int)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1 (got {top_k})")
    seed = sp.get("seed", sp.get("sampling_seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.seed must be an integer (got {seed!r})")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("sampling_params.ignore_eos must be a boolean")
    return dict(
        temperature=_num(sp, "temperature", 1.0, float, lo=0.0),
        top_p=_num(sp, "top_p", 1.0, float, lo=0.0, hi=1.0, lo_open=True),
        top_k=top_k,
        max_new_tokens=_num(sp, "max_new_tokens", 128, int, lo=0),
        n=_num(sp, "n", 1, int, lo=1, hi=1024),
        stop=[s for s in stop if s],
        stop_token_ids=list(stop_ids),
        seed=seed,
        ignore_eos=ignore_eos,
    )


class Front:
    """Generation routes, answered through the scheduler; the rest passed on to it."""

    def __init__(self, args: argparse.Namespace, tokenizer, control_port: int):
        self.args = args
        self.tokenizer = tokenizer
        self.control = aiohttp.ClientSession(
            f"http://127.0.0.1:{control_port}", auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None))  # a weight push may take minutes
        self.channel: Channel | None = None
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._generation_paths = set()
        self.model_path = args.model_path
        self.vocab_size = self.max_context_len = 0  # from the scheduler's hello

    def on_message(self, msg: dict) -> None:
        if "hello" in msg:  # the model is loaded: its facts, then the port opens
            info = msg["hello"]
            self.vocab_size, self.max_context_len = info["vocab_size"], info["max_context_len"]
            self.ready.set_result(None)
            return
        fut = self._waiting.pop(msg["k"], None)
        if fut is None or fut.done():  # its client went away
            return
        if "error" in msg:
            status, message = msg["error"]
            fut.set_exception(web.HTTPServiceUnavailable(reason=message) if status == 503
                              else RuntimeError(message))
        else:
            fut.set_result(SimpleNamespace(**msg["req"]))

    def app(self, routes: list[tuple[str, str, str]]) -> web.Application:
        app = web.Application(middlewares=[guard(self.args.api_key)], client_max_size=1 << 30)
        for method, path, handler in routes:
            if handler in GENERATION_HANDLERS:
                app.router.add_route(method, path, getattr(self, handler))
                self._generation_paths.add(path)
        app.router.add_route("*", "/{tail:.*}", self.pass_on)
        return app

    async def pass_on(self, request: web.Request) -> web.Response:
        """A control route, to the scheduler's server as it came (its key included)."""
        if request.path in self._generation_paths:
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        headers = {k: request.headers[k] for k in ("Authorization", "Content-Type")
                   if k in request.headers}
        async with self.control.request(request.method, str(request.rel_url),
                                        data=await request.read(), headers=headers) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                headers={"Content-Type": resp.headers.get(
                                    "Content-Type", "application/octet-stream")})

    async def _run(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
                   group_rid: str | None = None):
        """One sequence, generated by the scheduler; its client going away aborts it there."""
        key = next(self._keys)
        fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        self.channel.send([{"k": key, "ids": ids, "sp": sp, "rid": rid, "lp": return_logprob,
                            "g": group_rid}])
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(key, None) is not None:
                self.channel.send([{"k": key, "cancel": True}])
            raise

    def _prompt_ids(self, text, input_ids) -> list[int]:
        if input_ids is not None:
            # type() is int, not isinstance: JSON's true/false are not token ids; and half
            # the per-token cost (a generate request's validation, 250 ids: 40 -> 18 us).
            if not isinstance(input_ids, list) or not all(type(t) is int for t in input_ids):
                raise BadRequest("input_ids must be a list of integers")
            ids = input_ids
        elif isinstance(text, str):
            ids = self.tokenizer.encode(text)
        else:
            raise BadRequest("give either 'text' (a string) or 'input_ids' (a list of token ids)")
        if not ids:
            raise BadRequest("the prompt is empty")
        if len(ids) >= self.max_context_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens; this server's context length is "
                             f"{self.max_context_len} (prompt + new tokens)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = [t for t in ids if t < 0 or t >= self.vocab_size]
            raise BadRequest(f"input_ids contains ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        return ids

    def _text(self, req) -> str:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if req.matched_stop:  # SGLang trims the matched stop string from the text
            cut = text.find(req.matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def _format(self, req, t0: float) -> dict:
        meta = {"id": req.rid, "finish_reason": req.finish_reason,
                "prompt_tokens": req.prompt_tokens, "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens, "weight_version": req.weight_version,
                "weight_versions": req.weight_versions or [req.weight_version],
                "e2e_latency": time.perf_counter() - t0}
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                             zip(req.logprobs, req.output_ids)]
            meta["input_token_logprobs"] = []
        return {"text": self._text(req), "output_ids": req.output_ids, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        body = await read_body(request)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the hf engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None and isinstance(body.get("prompt"), str):
            text = body["prompt"]
        batch = (isinstance(text, list) or (isinstance(input_ids, list) and input_ids
                                            and isinstance(input_ids[0], list)))
        if input_ids is not None:  # token ids win; never tokenize when they are given
            prompts = [self._prompt_ids(None, i) for i in (input_ids if batch else [input_ids])]
        else:
            prompts = [self._prompt_ids(t, None) for t in (text if batch else [text])]
        sps = body.get("sampling_params")
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        if len(sps) != len(prompts):
            raise BadRequest("sampling_params list must have one entry per prompt")
        params = [sampling(s) for s in sps]
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        return_logprob = bool(body.get("return_logprob", False))
        jobs = []
        for ids, sp, rid in zip(prompts, params, rids):
            if len(ids) + 1 > self.max_context_len:
                raise BadRequest("prompt leaves no room for new tokens in the context")
            for k in range(sp["n"]):
                r = str(rid) if rid is not None else uuid.uuid4().hex
                if sp["n"] > 1:
                    r = f"{r}-{k}" if rid is not None else r
                jobs.append(self._run(ids, sp, r, return_logprob,
                                      str(rid) if rid is not None and sp["n"] > 1 else None))
        reqs = await _all(jobs)
        out = [self._format(r, t0) for r in reqs]
        return json_response(out if (batch or len(out) > 1) else out[0])

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True, **kwargs)
        except Exception as exc:
            raise BadRequest(f"could not apply the chat template: {exc}") from None
        return await self._openai_completion(body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (token-id and batched prompts: use /generate)")
        return await self._openai_completion(body, prompt, chat=False)

    async def _openai_completion(self, body: dict, prompt: str, *, chat: bool) -> web.Response:
        """OpenAI's chat.completion / text_completion for one rendered prompt."""
        t0 = time.perf_counter()
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the hf engine")
        ids = self._prompt_ids(None, self.tokenizer.encode(prompt, add_special_tokens=False))
        sp = {k: body[k] for k in ("temperature", "top_p", "top_k", "n", "stop", "seed")
              if body.get(k) is not None}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        sp["max_new_tokens"] = max_tokens if max_tokens is not None else \
            self.max_context_len - len(ids)
        sp = sampling(sp)
        sp["max_new_tokens"] = min(sp["max_new_tokens"], self.max_context_len - len(ids))
        rid = uuid.uuid4().hex
        reqs = await _all([self._run(ids, sp, f"{rid}-{k}", False) for k in range(sp["n"])])
        choices = []
        for k, r in enumerate(reqs):
            kind = r.finish_reason["type"]
            choice = {"index": k, "finish_reason": {"stop": "stop", "length": "length"}.get(kind, kind)}
            if chat:
                choice["message"] = {"role": "assistant", "content": self._text(r)}
            else:
                choice.update(text=self._text(r), logprobs=None)
            choices.append(choice)
        completion = sum(len(r.output_ids) for r in reqs)
        return json_response({"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                              "object": "chat.completion" if chat else "text_completion",
                              "created": int(time.time()),
                              "model": body.get("model") or self.model_path, "choices": choices,
                              "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                                        "total_tokens": len(ids) + completion},
                              "metadata": {"weight_version": reqs[0].weight_version,
                                           "latency_s": time.perf_counter() - t0}})


def _become_the_front() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    # The scheduler killed outright (SIGKILL, OOM) takes its front with it; its exit is
    # otherwise seen as the channel closing.
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Its command line is the scheduler's (forked); top and ps -o comm tell them apart.
    libc.prctl(15, b"hf-front")  # PR_SET_NAME


async def _serve(args: argparse.Namespace, channel_sock: socket.socket, control_port: int,
                 routes: list[tuple[str, str, str]]) -> None:
    from transformers import AutoTokenizer

    front = Front(args, AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path),
                  control_port)
    front.channel = await Channel.open(channel_sock, front.on_message, lambda: os._exit(0))
    await front.ready
    runner = web.AppRunner(front.app(routes), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)  # readers never see a half-written file
    log.warning("hf engine serving %s on http://%s:%d", args.model_path, args.host, port)
    await asyncio.Event().wait()


def run(args: argparse.Namespace, channel_sock: socket.socket, control_port: int,
        routes: list[tuple[str, str, str]]) -> None:
    """The front process's life, in the child forked by server.main; never returns."""
    _become_the_front()

    async def serve() -> None:
        try:
            await _serve(args, channel_sock, control_port, routes)
        except Exception:  # logged while the channel is still open: before the scheduler's
            log.exception("the engine's HTTP front failed")  # "front exited" line
            os._exit(1)

    try:
        uvloop.run(serve())
    except KeyboardInterrupt:
        pass
    os._exit(0)  # never the parent's atexit handlers or buffered output
