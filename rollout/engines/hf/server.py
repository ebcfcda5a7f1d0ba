"""homegym's CPU inference server: a transformers model behind SGLang's HTTP routes.

    python -m rollout.engines.hf.server --model-path P --host 127.0.0.1 --port N \
        [--api-key K] [--torch-threads 1] [--max-context-len L] [--dtype float32]

Everything above the engine (router, rollout manager, user generate functions, trainer
weight sync) speaks SGLang's contract, so it cannot tell this server from SGLang: the
routes it serves are the pinned SGLang version's (``--contract-version`` picks another
supported one; tests/test_sglang_contract.py checks them against each wheel's source),
with that version's fields, answers and refusals: unknown keys are ignored, the weight
version is in ``/model_info``, ``flush_cache`` and ``release_memory_occupation`` refuse a
busy server, and under 0.5.23 tensor and distributed weight updates need a session
(``/begin_weight_update`` .. ``/end_weight_update``). Its extensions, which no code that
also talks to SGLang relies on: ``meta_info.weight_versions`` (every version a partial
rollout's tokens came from) and the engine statistics in ``/server_info``.

The model runs on one scheduler thread with continuous batching (see batcher.py); this
module is the HTTP layer: parse and validate, hand requests to the batcher, format SGLang's
responses. Requests with ``input_ids`` are never tokenized; JSON goes through orjson.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import glob
import logging
import os
import sys
import threading
import time
import uuid
import zlib
from typing import Any, Iterable, Optional

import orjson
import torch
import uvloop
from aiohttp import web

from rollout.checkpoints import is_vlm, read_config
from rollout.engines.hf import fast_kernels, llama_family
from rollout.engines.hf.batcher import Batcher, Request
from rollout.engines.client import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from rollout.engines.weights_io import deserialize_named_tensors, init_custom_process_group

# How long a weight-update receive waits for the trainer's broadcast (init_weights_update_group).
WEIGHT_GROUP_TIMEOUT_S = 60.0

log = logging.getLogger("homegym.hf_server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Routes that answer without the api key (SGLang leaves /health open for probes).
OPEN_ROUTES = {"/health"}
# The routes whose handler is cancelled when its client goes away, which aborts the
# request's rows (`Server._run`), as SGLang aborts a disconnected client's request. Every
# other handler runs to its end (a weight update half-recorded helps no one).
CANCELLABLE_ROUTES = {"/generate", "/v1/chat/completions", "/v1/completions"}
# Versions whose tensor / distributed weight updates need a weight-update session.
SESSION_VERSIONS = {"0.5.23"}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# A vision-language checkpoint (Qwen3.5's) keeps its text model under this prefix; the
# engine serves the text model alone (transformers' AutoModelForCausalLM, as SGLang's
# language_model_only), so updates may name tensors either way, and the vision tower's and
# MTP layer's tensors are accepted and left out, as SGLang's loader skips them.
VLM_TEXT_PREFIX = "model.language_model."
VLM_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
BUSY = ("requests are still running or queued; retract or finish them first "
        "(When there are running or waiting requests, the operation will not be performed.)")


class BadRequest(ValueError):
    """A client mistake: answered with HTTP 400 and this message."""


class StartupError(RuntimeError):
    """What this server cannot serve: one line, exit status 2."""


def perturb(named: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
    """w <- w * (1 + scale * eps) in place, eps ~ N(0, 1) drawn from a generator seeded by
    the tensor's name: every engine and every weight update gets the same perturbation, a
    known, steady train/rollout mismatch for tests and benchmarks (``--weight-noise``)."""
    with torch.no_grad():
        for name, tensor in named:
            if not tensor.is_floating_point():
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            eps = torch.randn(tuple(tensor.shape), generator=gen, dtype=torch.float32)
            tensor.mul_((1.0 + scale * eps).to(tensor.dtype))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            405: "MethodNotAllowed", 503: "ServiceUnavailable"}.get(status, "Error")
    return _json({"error": {"message": message, "type": kind, "code": status},
                  "success": False, "message": message}, status)


async def _all(jobs: list) -> list:
    """``asyncio.gather`` of the jobs, but a lone one awaited in place: gather wraps each in
    a task, 17 us a request on this path (a generate request's HTTP work is ~350 us) for
    the usual n=1. A client that goes away cancels the lone job as it would a gathered one."""
    if len(jobs) == 1:
        return [await jobs[0]]
    return await asyncio.gather(*jobs)


async def _body(request: web.Request) -> dict:
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


def routes(contract_version: str) -> list[tuple[str, str, str]]:
    """(method, path, handler) of every route served under ``contract_version``: the
    routes and methods of that SGLang version (tests/test_sglang_contract.py checks)."""
    table = [("POST", "/generate", "generate"), ("POST", "/v1/chat/completions", "chat_completions"),
             ("POST", "/v1/completions", "completions")]
    for path, handler in [("/health", "health"), ("/health_generate", "health_generate"),
                          ("/get_model_info", "model_info"), ("/model_info", "model_info"),
                          ("/get_server_info", "server_info"), ("/server_info", "server_info"),
                          ("/v1/models", "v1_models")]:
        table.append(("GET", path, handler))
    for path, handler in [("/flush_cache", "flush_cache"),
                          ("/get_weights_by_name", "get_weights_by_name"),
                          ("/release_memory_occupation", "release_memory"),
                          ("/resume_memory_occupation", "resume_memory")]:
        table += [("GET", path, handler), ("POST", path, handler)]
    for path, handler in [("/abort_request", "abort_request"),
                          ("/update_weights_from_tensor", "update_weights_from_tensor"),
                          ("/init_weights_update_group", "init_weights_update_group"),
                          ("/destroy_weights_update_group", "destroy_weights_update_group"),
                          ("/update_weights_from_distributed", "update_weights_from_distributed"),
                          ("/update_weights_from_disk", "update_weights_from_disk"),
                          ("/pause_generation", "pause_generation"),
                          ("/continue_generation", "continue_generation")]:
        table.append(("POST", path, handler))
    if contract_version in SESSION_VERSIONS:
        table += [("POST", "/begin_weight_update", "begin_weight_update"),
                  ("POST", "/end_weight_update", "end_weight_update")]
    return table


class Server:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoConfig, AutoTokenizer

        self.args = args
        self.model_path = args.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.model = None
        fast = args.attn_implementation == "eager" and not args.disable_fast_attention
        if fast:  # the engine's own forward on the Llama family, without transformers' classes
            self.model = llama_family.load(args.model_path, AutoConfig.from_pretrained(
                args.model_path), DTYPES[args.dtype])
        if self.model is None:
            from transformers import AutoModelForCausalLM

            # register(): eager's math without copying K/V per step
            attn = fast_kernels.register() if fast else args.attn_implementation
            self.model = AutoModelForCausalLM.from_pretrained(
                args.model_path, dtype=DTYPES[args.dtype], attn_implementation=attn)
            self.model.eval()
        self.vlm_checkpoint = is_vlm(read_config(args.model_path))
        if args.weight_noise:
            perturb(self.model.named_parameters(), args.weight_noise)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context_len = int(args.max_context_len or getattr(cfg, "max_position_embeddings", 4096))
        eos = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        self.eos_ids = eos
        try:
            self.batcher = Batcher(self.model, self.tokenizer, eos, self.max_context_len,
                                   max_batch_size=args.max_running_requests,
                                   weight_version=args.weight_version,
                                   prefix_cache_bytes=int(args.prefix_cache_mb * (1 << 20)))
        except ValueError as exc:  # a model the engine cannot run (hybrid.refusal)
            raise StartupError(str(exc)) from None
        self.groups: dict[str, Any] = {}
        self.released_shapes: Optional[dict] = None
        self.weights_need_update = False
        self.released_tags: set[str] = set()
        self.contract_version = args.contract_version
        self.weight_session = False  # open /begin_weight_update session (0.5.23)
        # Finished requests waiting for the event loop; one wake-up per batch of them.
        self._finished: list[tuple[asyncio.Future, Request]] = []
        self._finished_lock = threading.Lock()
        # SGLang's pause: new generation requests wait in the HTTP layer (its tokenizer
        # manager, managers/tokenizer_manager.py:804-805 in 0.5.18), so they never reach
        # the scheduler of a paused engine and a flush can run under them.
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._held = 0  # requests waiting for continue_generation
        # Set whenever requests finish: a deferred flush (/flush_cache?timeout=) re-checks.
        self._settled = asyncio.Event()
        self._flush_pending = False

    # ---- plumbing ----
    def _request_finished(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future,
                          req: Request) -> None:
        """Called on the scheduler thread. A decode step often finishes several requests
        at once; one loop wake-up (a pipe write) serves all of them. py-spy on the
        engine in bench_vs_trl's multi-turn run: wake-ups took 5.6% of the scheduler
        thread's time one per request, 4.0% batched."""
        with self._finished_lock:
            self._finished.append((fut, req))
            first = len(self._finished) == 1
        if first:
            loop.call_soon_threadsafe(self._settle_finished)

    def _settle_finished(self) -> None:
        with self._finished_lock:
            done, self._finished = self._finished, []
        for fut, req in done:
            if not fut.done():
                fut.set_result(req)
        self._settled.set()

    async def on_scheduler(self, fn):
        """Run ``fn`` on the scheduler thread between decode steps and await its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result, err):
            def settle():
                if fut.done():
                    return
                if err is not None:
                    fut.set_exception(err)
                else:
                    fut.set_result(result)
            loop.call_soon_threadsafe(settle)

        self.batcher.call(fn, done)
        return await fut

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware], client_max_size=1 << 30)
        for method, path, handler in routes(self.contract_version):
            app.router.add_route(method, path, getattr(self, handler))
        return app

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        key = self.args.api_key
        if key and request.path not in OPEN_ROUTES:
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                return _error("missing or wrong api key (send 'Authorization: Bearer <key>')", 401)
        try:
            if request.path in CANCELLABLE_ROUTES:
                return await handler(request)
            return await asyncio.shield(handler(request))
        except BadRequest as exc:
            return _error(str(exc), 400)
        except web.HTTPException as exc:  # unknown route / wrong method -> JSON, not HTML
            if exc.status == 404 and request.path in ("/get_weight_version", "/weight_version"):
                return _error(f"Endpoint '{request.path}' is deprecated. Please use "
                              "'/model_info' instead.", 404)
            if exc.status == 404:
                return _error(f"unknown route {request.method} {request.path}", 404)
            return _error(f"{exc.reason} for {request.method} {request.path}", exc.status)
        except Exception as exc:  # a bug must not take the server down
            log.exception("error in %s", request.path)
            return _error(f"internal error: {type(exc).__name__}: {exc}", 500)

    # ---- generation ----
    def _sampling(self, sp: Any) -> dict:
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
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(stop_ids),
            seed=seed,
            ignore_eos=ignore_eos,
        )

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

    async def _run(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
                   group_rid: Optional[str] = None) -> Request:
        if not self._unpaused.is_set():  # held while paused, as SGLang holds them
            self._held += 1
            try:
                await self._unpaused.wait()
            finally:
                self._held -= 1
        if self.weights_need_update or self.released_tags:
            raise web.HTTPServiceUnavailable(reason="memory released; /resume_memory_occupation "
                                                    "and push weights before generating")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        req = Request(rid=rid, input_ids=ids, max_new_tokens=sp["max_new_tokens"],
                      temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                      stop_token_ids=sp["stop_token_ids"], stop=sp["stop"],
                      ignore_eos=sp["ignore_eos"], seed=sp["seed"],
                      return_logprob=return_logprob, group_rid=group_rid,
                      on_done=functools.partial(self._request_finished, loop, fut))
        if req.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            req.weight_version = self.batcher.weight_version
            return req
        self.batcher.submit(req)
        try:
            return await fut
        except asyncio.CancelledError:  # client went away: free the row
            self.batcher.abort(rid=rid)
            raise

    def _text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if req.matched_stop:  # SGLang trims the matched stop string from the text
            cut = text.find(req.matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def _format(self, req: Request, t0: float) -> dict:
        meta = {"id": req.rid, "finish_reason": req.finish_reason,
                "prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
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
        body = await _body(request)
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
        params = [self._sampling(s) for s in sps]
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
        return _json(out if (batch or len(out) > 1) else out[0])

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await _body(request)
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
        body = await _body(request)
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
        sp = self._sampling(sp)
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
        return _json({"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                      "object": "chat.completion" if chat else "text_completion",
                      "created": int(time.time()),
                      "model": body.get("model") or self.model_path, "choices": choices,
                      "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                                "total_tokens": len(ids) + completion},
                      "metadata": {"weight_version": reqs[0].weight_version,
                                   "latency_s": time.perf_counter() - t0}})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            self.batcher.abort(abort_all=True)
        elif body.get("rid"):
            self.batcher.abort(rid=str(body["rid"]))
        else:
            raise BadRequest("give 'rid' or 'abort_all': true")
        return _json({"success": True})

    # ---- info ----
    async def health(self, request):
        return web.Response(text="")

    async def health_generate(self, request):
        if self.weights_need_update or self.released_tags:
            return _error("weights released", 503)
        sp = self._sampling({"max_new_tokens": 1, "temperature": 0})
        await self._run([self.eos_ids and min(self.eos_ids) or 0], sp, "health-" + uuid.uuid4().hex, False)
        return web.Response(text="")

    async def model_info(self, request):
        return _json({"model_path": self.model_path, "tokenizer_path": self.args.tokenizer_path
                      or self.model_path, "is_generation": True, "preferred_sampling_params": None,
                      "weight_version": self.batcher.weight_version, "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": self.model.config.model_type,
                      "architectures": getattr(self.model.config, "architectures", None)})

    async def server_info(self, request):
        return _json({"version": self.contract_version, "engine": "homegym-hf",
                      "model_path": self.model_path,
                      "context_length": self.max_context_len, "max_context_len": self.max_context_len,
                      "dtype": self.args.dtype, "weight_version": self.batcher.weight_version,
                      "num_running_reqs": self.batcher.num_running, "paused": self.batcher.paused,
                      "num_held_reqs": self._held,
                      "released": self.released_shapes is not None,
                      "decode_steps": self.batcher.steps, **self.batcher.stats,
                      "prefix_cache_hits": self.batcher.prefix_cache.hits,
                      "prefix_cache_hit_tokens": self.batcher.prefix_cache.hit_tokens,
                      "prefix_cache_mb": self.batcher.prefix_cache.bytes / (1 << 20), "max_running_requests":
                      self.args.max_running_requests, "api_key_required": bool(self.args.api_key)})

    async def v1_models(self, request):
        return _json({"object": "list", "data": [{"id": self.model_path, "object": "model",
                                                  "owned_by": "homegym"}]})

    def _flush_if_idle(self) -> bool:
        """On the scheduler thread: clear the prefix cache unless requests are pending
        (SGLang's rule: a flush never drops KV that a request is still using)."""
        if self.batcher.num_running:
            return False
        self.batcher.prefix_cache.clear()
        return True

    async def flush_cache(self, request):
        """SGLang's flush (0.5.18 entrypoints/http_server.py:966-981): at once, refused while
        a request is queued or running; with ``?timeout=T`` (> 0) deferred until the engine
        is idle, at most T seconds, one such flush at a time
        (managers/scheduler_components/flush_wrapper.py:24-65)."""
        try:
            timeout = float(request.query.get("timeout", 0.0))
        except ValueError:
            raise BadRequest("timeout must be a number") from None
        if timeout < 0:
            raise BadRequest("timeout must be >= 0")
        if timeout > 0:
            if self._flush_pending:
                return web.Response(text="Another flush_cache is already in progress.",
                                    status=400)
            self._flush_pending = True
            try:
                flushed = await self._flush_when_idle(timeout)
            finally:
                self._flush_pending = False
            if not flushed:
                return web.Response(text="Timed out waiting for idle state.", status=400)
        elif not await self.on_scheduler(self._flush_if_idle):
            return web.Response(text=f"Cache not flushed: {BUSY}\n", status=400)
        return web.Response(text="Cache flushed.\n")

    async def _flush_when_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._settled.clear()  # before the check: a request finishing after it wakes us
            if await self.on_scheduler(self._flush_if_idle):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._settled.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def pause_generation(self, request):
        body = await _body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode must be abort, in_place or retract")
        self._unpaused.clear()
        if mode == "abort":
            self.batcher.abort(abort_all=True)
        await self.on_scheduler(lambda: setattr(self.batcher, "paused", True))
        return _json({"success": True})

    async def continue_generation(self, request):
        self.batcher.paused = False
        self.batcher.wakeup.set()
        self._unpaused.set()
        return _json({"success": True})

    async def get_weights_by_name(self, request):
        body = await _body(request)
        name = self._engine_name(body.get("name"))
        if self.args.weight_noise:
            # What it serves is not what it was sent: the sender's check would fail. The
            # client takes this error as "cannot report" and verifies by version only.
            return _error("weights perturbed by --weight-noise (rollout.weight_noise) are "
                          "not reported", 400)
        sd = self.model.state_dict()
        if name not in sd:
            return _error("Get parameter by name failed", 400)
        trunc = int(body.get("truncate_size", 100))
        # Slice before the cast: the embedding cast whole is 100+ MB for four rows.
        return _json(sd[name][:trunc].to(torch.float32).tolist())

    async def begin_weight_update(self, request):
        await _body(request)
        if self.weight_session:
            return _json({"success": False, "message": "a weight-update session is already "
                          "open; call end_weight_update() first"}, 400)
        self.weight_session = True
        return _json({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await _body(request)
        if not self.weight_session:
            return _json({"success": False, "message": "no weight-update session is open; "
                          "call begin_weight_update() first"}, 400)
        self.weight_session = False
        return _json({"success": True, "message": "Success"})

    def _check_session(self, route: str) -> None:
        if self.contract_version in SESSION_VERSIONS and not self.weight_session:
            raise BadRequest(f"{route} must run between begin_weight_update() and "
                             "end_weight_update()")

    # ---- weights ----
    def _engine_name(self, name):
        """The engine's parameter name for a tensor named as in the checkpoint; None for a
        vision-language checkpoint's tensors the text model does not have."""
        if self.vlm_checkpoint and isinstance(name, str):
            if name.startswith(VLM_TEXT_PREFIX):
                return "model." + name[len(VLM_TEXT_PREFIX):]
            if name.startswith(VLM_SKIPPED_PREFIXES):
                return None
        return name

    def _apply(self, named: list[tuple[str, torch.Tensor]], body: dict) -> dict:
        """Validate everything, then copy: a bad update leaves the old weights untouched.
        Then flush the prefix cache if asked (SGLang's default), which fails the call
        when requests are pending; not asked, the cache is kept."""
        version = body.get("weight_version")
        if self.released_shapes is not None:
            raise BadRequest("weights are released; call /resume_memory_occupation first")
        sd = self.model.state_dict()
        named = [(n, t) for n, t in ((self._engine_name(n), t) for n, t in named) if n is not None]
        for name, tensor in named:
            if name not in sd:
                raise BadRequest(f"unknown parameter {name!r}")
            if tuple(sd[name].shape) != tuple(tensor.shape):
                raise BadRequest(f"shape mismatch for {name}: engine {tuple(sd[name].shape)}, "
                                 f"update {tuple(tensor.shape)}")
        with torch.no_grad():
            for name, tensor in named:
                sd[name].copy_(tensor)
        if self.args.weight_noise:
            perturb(((name, sd[name]) for name, _ in named), self.args.weight_noise)
        if version is not None:
            self.batcher.weight_version = str(version)
        self.batcher.note_weight_update(None if version is None else self.batcher.weight_version)
        self.weights_need_update = False
        # As SGLang: the prefix cache stays unless the update asks for a flush
        # (flush_cache, default true; 0.5.18 managers/scheduler_components/
        # weight_updater.py:103-108). Its KV then belongs to the old weights: whoever
        # pushes with flush_cache=false flushes before new requests may use it.
        if body.get("flush_cache", True) and not self._flush_if_idle():
            raise BadRequest(f"Weights were updated, but the cache was not flushed because {BUSY}")
        return {"success": True, "message": f"updated {len(named)} tensors",
                "weight_version": self.batcher.weight_version}

    async def _weights_call(self, fn) -> web.Response:
        try:
            return _json(await self.on_scheduler(fn))
        except BadRequest as exc:
            return _json({"success": False, "message": str(exc)}, 400)

    async def update_weights_from_tensor(self, request):
        body = await _body(request)
        self._check_session("update_weights_from_tensor")
        payload = body.get("serialized_named_tensors")
        if not (isinstance(payload, list) and payload and all(isinstance(p, str) for p in payload)):
            raise BadRequest("serialized_named_tensors must be a non-empty list of base64 "
                             "strings, one per TP rank")
        try:  # one entry per TP rank; this engine has one rank
            named = deserialize_named_tensors(payload[0], body.get("load_format"))
        except Exception as exc:
            raise BadRequest(f"could not deserialize serialized_named_tensors: {exc}") from None
        named = [(str(n), t) for n, t in named]
        return await self._weights_call(lambda: self._apply(named, body))

    async def update_weights_from_disk(self, request):
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise BadRequest(f"model_path must be an existing checkpoint directory (got {path!r})")

        def load():
            from safetensors.torch import load_file
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if files:
                sd = {}
                for f in files:
                    sd.update(load_file(f))
            else:
                files = sorted(glob.glob(os.path.join(path, "*.bin")))
                if not files:
                    raise BadRequest(f"no *.safetensors or *.bin weights in {path}")
                sd = {}
                for f in files:
                    sd.update(torch.load(f, map_location="cpu", weights_only=True))
            return list(sd.items())

        named = await asyncio.to_thread(load)
        return await self._weights_call(lambda: self._apply(named, body))

    async def init_weights_update_group(self, request):
        body = await _body(request)
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in body:
                raise BadRequest(f"missing field {key!r}")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend") or "gloo"
        if backend == "nccl":
            backend = "gloo"  # the CPU engine receives over gloo whatever the GPU side says
        init = f"tcp://{body['master_address']}:{int(body['master_port'])}"
        try:
            # Each receive waits at most this long for the trainer: a broadcast broken off
            # (another engine died mid-push) would otherwise hold this engine's scheduler in
            # a receive whose tensors never come; the trainer waits for this call's answer
            # and the next push needs the scheduler. Tensors follow their request at once.
            pg = await asyncio.to_thread(init_custom_process_group, backend, init,
                                         int(body["world_size"]), int(body["rank_offset"]), name,
                                         timeout_s=WEIGHT_GROUP_TIMEOUT_S)
        except Exception as exc:
            return _json({"success": False, "message": f"init_weights_update_group failed: {exc}"}, 400)
        self.groups[name] = pg
        return _json({"success": True, "message": f"joined {name} as rank {body['rank_offset']}"})

    async def destroy_weights_update_group(self, request):
        body = await _body(request)
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        if pg is None:
            raise BadRequest(f"no weights update group {name!r}")
        import torch.distributed as dist
        dist.destroy_process_group(pg)
        return _json({"success": True})

    async def update_weights_from_distributed(self, request):
        import torch.distributed as dist

        body = await _body(request)
        self._check_session("update_weights_from_distributed")
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.get(name)
        if pg is None:
            raise BadRequest(f"no weights update group {name!r}; call /init_weights_update_group")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must be lists of the same length")
        try:
            dts = [getattr(torch, str(d).replace("torch.", "")) for d in dtypes]
        except AttributeError as exc:
            raise BadRequest(f"unknown dtype: {exc}") from None

        def receive():
            # Receive every tensor first (the trainer broadcasts them all regardless), then
            # validate and apply, so a mismatch leaves the old weights in place.
            named = []
            for n, d, s in zip(names, dts, shapes):
                t = torch.empty(tuple(s), dtype=d)
                dist.broadcast(t, src=0, group=pg)
                named.append((n, t))
            return self._apply(named, body)

        return await self._weights_call(receive)

    @staticmethod
    def _tags(body: dict) -> set[str]:
        tags = body.get("tags")
        if tags is None or tags == []:
            return set(MEMORY_TAGS)
        if not (isinstance(tags, list) and set(tags) <= set(MEMORY_TAGS)):
            raise BadRequest(f"tags must be null or a list of {', '.join(MEMORY_TAGS)}")
        return set(tags)

    async def release_memory(self, request):
        tags = self._tags(await _body(request))

        def release():
            if self.batcher.num_running:
                raise BadRequest("release_memory_occupation should be called only when "
                                 "server is idle.")
            if "kv_cache" in tags:
                self.batcher.reset_batch("memory released")
                self.batcher.prefix_cache.clear()
            if "weights" in tags and self.released_shapes is None:
                self.batcher.drop_weight_copies()
                shapes = {}
                for n, p in self.model.named_parameters():
                    shapes[n] = (p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype)
                self.released_shapes = shapes
            self.released_tags |= tags
            self.batcher.released = True
            return None

        import gc
        await self.on_scheduler(release)
        # A full collection costs ~0.1-0.7 s in a process holding torch + transformers; it
        # only matters when the released weights are big (refcounting frees the rest).
        if sum(s.numel() * d.itemsize for s, d in (self.released_shapes or {}).values()) > 256 << 20:
            gc.collect()
        return _json(None)

    async def resume_memory(self, request):
        tags = self._tags(await _body(request))

        def resume():
            if self.released_shapes is not None and "weights" in tags:
                # Like SGLang without a CPU backup, the weights come back allocated but not
                # loaded: the trainer must push weights before the next generate.
                params = dict(self.model.named_parameters())
                for n, (shape, dtype) in self.released_shapes.items():
                    params[n].data = torch.zeros(shape, dtype=dtype)
                self.released_shapes = None
                self.weights_need_update = True
            self.released_tags -= tags
            self.batcher.released = bool(self.released_tags)
            return None

        await self.on_scheduler(resume)
        return _json(None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--api-key", default=None)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--attn-implementation", default="eager")
    p.add_argument("--disable-fast-attention", action="store_true",
                   help="use transformers' eager attention as is (see hf/fast_kernels.py)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--weight-noise", type=float, default=0.0,
                   help="extension, for tests and benchmarks: multiply every weight loaded by "
                        "1 + NOISE * N(0, 1), fixed per tensor name (a known mismatch)")
    p.add_argument("--prefix-cache-mb", type=float, default=256,
                   help="KV of finished sequences kept for multi-turn prompts (0 = off)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--contract-version", default=PINNED_SGLANG_VERSION,
                   choices=SUPPORTED_SGLANG_VERSIONS,
                   help="the SGLang version whose HTTP contract to serve")
    args = p.parse_args(argv)
    if args.torch_threads < 1:
        p.error("--torch-threads must be >= 1")
    if args.weight_noise < 0:
        p.error("--weight-noise must be >= 0")
    return args


async def serve(args: argparse.Namespace) -> None:
    server = Server(args)
    server.batcher.start()
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
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


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
    torch.set_num_threads(args.torch_threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # router's HTTP/2 probe
    try:
        # libuv's event loop: the HTTP thread's per-request socket, selector and callback
        # work in C rather than asyncio's Python (docs/performance.md, "Where the engine's
        # time goes").
        uvloop.run(serve(args))
    except KeyboardInterrupt:
        pass
    except StartupError as exc:
        print(f"homegym: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
