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

The engine is two processes. This one, the scheduler process, owns the model: its
batcher thread runs continuous batching (batcher.py), and its main thread serves the
control routes (weights, flush, pause, memory, info) on a loopback port and admits the
generation requests that the HTTP front (front.py, forked from it at start-up) sends over
a socket. The front listens on the engine's port: it parses, validates and tokenizes, and
formats SGLang's responses; control requests it passes on here as they came. Requests
with ``input_ids`` are never tokenized; JSON goes through orjson.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import glob
import logging
import os
import socket
import sys
import threading
import uuid
import zlib
from typing import Any, Iterable, Optional

import torch
import uvloop
from aiohttp import web

from rollout.checkpoints import is_vlm, read_config
from rollout.engines.hf import fast_kernels, front, llama_family
from rollout.engines.hf.batcher import Batcher, Request
from rollout.engines.hf.channel import Channel
from rollout.engines.hf.httpio import BadRequest, error_response, guard, json_response, log, read_body
from rollout.engines.client import PINNED_SGLANG_VERSION, SUPPORTED_SGLANG_VERSIONS
from rollout.engines.weights_io import (
    FLATTENED_BUCKET, broadcast_bucket_views, deserialize_named_tensors, init_custom_process_group)

# How long a weight-update receive waits for the trainer's broadcast (init_weights_update_group).
WEIGHT_GROUP_TIMEOUT_S = 60.0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
                          ("/resume_memory_occupation", "resume_memory"),
                          ("/freeze_gc", "freeze_gc")]:
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
        # Finished requests waiting for the event loop, with their waiter (a future, or the
        # key of the front's request); one wake-up and one frame per batch of them.
        self._finished: list[tuple[Any, Request]] = []
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
        self.channel: Optional[Channel] = None  # to the front (front.py)
        # The front's requests by its key: the rid of one admitted, or the task of one
        # held while paused.
        self._remote: dict[int, Any] = {}

    # ---- plumbing ----
    def _request_finished(self, loop: asyncio.AbstractEventLoop, waiter, req: Request) -> None:
        """Called on the scheduler thread. A decode step often finishes several requests
        at once; one loop wake-up (a pipe write) serves all of them. py-spy on the
        engine in bench_vs_trl's multi-turn run: wake-ups took 5.6% of the scheduler
        thread's time one per request, 4.0% batched."""
        with self._finished_lock:
            self._finished.append((waiter, req))
            first = len(self._finished) == 1
        if first:
            loop.call_soon_threadsafe(self._settle_finished)

    def _settle_finished(self) -> None:
        with self._finished_lock:
            done, self._finished = self._finished, []
        answers = []
        for waiter, req in done:
            if isinstance(waiter, int):  # the front's request of this key
                if self._remote.pop(waiter, None) is not None:
                    answers.append(self._result(waiter, req))
            elif not waiter.done():
                waiter.set_result(req)
        if answers:
            self.channel.send(answers)
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
        """The control routes: every route but the front's generation routes."""
        app = web.Application(middlewares=[guard(self.args.api_key)], client_max_size=1 << 30)
        for method, path, handler in routes(self.contract_version):
            if handler not in front.GENERATION_HANDLERS:
                app.router.add_route(method, path, getattr(self, handler))
        return app

    # ---- the front's generation requests ----
    def info(self) -> dict:
        """What the front needs to validate prompts."""
        return {"vocab_size": self.vocab_size, "max_context_len": self.max_context_len}

    def on_message(self, msg: dict) -> None:
        """A request from the front, or its cancellation (its client went away). Admitted
        in place, without a task: the front's requests are this process's only per-request
        Python work besides the scheduler's."""
        key = msg["k"]
        if "cancel" in msg:
            job = self._remote.pop(key, None)
            if isinstance(job, asyncio.Task):
                job.cancel()
            elif job is not None:
                self.batcher.abort(rid=job)
            return
        if self._unpaused.is_set():
            self._admit_remote(key, msg)
        else:
            self._remote[key] = asyncio.ensure_future(self._when_unpaused(key, msg))

    async def _when_unpaused(self, key: int, msg: dict) -> None:
        try:
            await self._while_paused()
        except asyncio.CancelledError:  # its client went away
            return
        self._admit_remote(key, msg)

    def _admit_remote(self, key: int, msg: dict) -> None:
        self._remote[key] = msg["rid"]
        try:
            self._admit(msg["ids"], msg["sp"], msg["rid"], msg["lp"], msg["g"],
                        functools.partial(self._request_finished, asyncio.get_running_loop(), key))
        except web.HTTPServiceUnavailable as exc:
            del self._remote[key]
            self.channel.send([{"k": key, "error": [503, exc.reason]}])
        except Exception as exc:  # a bug: the front answers 500, the channel stays up
            log.exception("error in a generation request")
            del self._remote[key]
            self.channel.send([{"k": key, "error": [500, f"{type(exc).__name__}: {exc}"]}])

    @staticmethod
    def _result(key: int, req: Request) -> dict:
        return {"k": key, "req": {
            "rid": req.rid, "prompt_tokens": len(req.input_ids), "output_ids": req.output_ids,
            "logprobs": req.logprobs, "return_logprob": req.return_logprob,
            "finish_reason": req.finish_reason, "cached_tokens": req.cached_tokens,
            "weight_version": req.weight_version, "weight_versions": req.weight_versions,
            "matched_stop": req.matched_stop}}

    @staticmethod
    def front_gone() -> None:
        log.error("the engine's HTTP front exited; stopping")
        os._exit(1)

    # ---- generation ----
    def _admit(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
               group_rid: Optional[str], on_done) -> None:
        """One sequence to the batcher; ``on_done(req)`` on the scheduler thread when it
        ends. Refused (503) while the weights are released."""
        if self.weights_need_update or self.released_tags:
            raise web.HTTPServiceUnavailable(reason="memory released; /resume_memory_occupation "
                                                    "and push weights before generating")
        req = Request(rid=rid, input_ids=ids, max_new_tokens=sp["max_new_tokens"],
                      temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                      stop_token_ids=frozenset(sp["stop_token_ids"]), stop=tuple(sp["stop"]),
                      ignore_eos=sp["ignore_eos"], seed=sp["seed"],
                      return_logprob=return_logprob, group_rid=group_rid, on_done=on_done)
        if req.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            req.weight_version = self.batcher.weight_version
            on_done(req)
        else:
            self.batcher.submit(req)

    async def _while_paused(self) -> None:
        """New generation requests wait here while generation is paused, as SGLang's
        tokenizer manager holds them."""
        if not self._unpaused.is_set():
            self._held += 1
            try:
                await self._unpaused.wait()
            finally:
                self._held -= 1

    async def _run(self, ids: list[int], sp: dict, rid: str, return_logprob: bool,
                   group_rid: Optional[str] = None) -> Request:
        await self._while_paused()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._admit(ids, sp, rid, return_logprob, group_rid,
                    functools.partial(self._request_finished, loop, fut))
        try:
            return await fut
        except asyncio.CancelledError:  # client went away: free the row
            self.batcher.abort(rid=rid)
            raise

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        if body.get("abort_all"):
            self.batcher.abort(abort_all=True)
        elif body.get("rid"):
            self.batcher.abort(rid=str(body["rid"]))
        else:
            raise BadRequest("give 'rid' or 'abort_all': true")
        return json_response({"success": True})

    # ---- info ----
    async def health(self, request):
        return web.Response(text="")

    async def health_generate(self, request):
        if self.weights_need_update or self.released_tags:
            return error_response("weights released", 503)
        sp = front.sampling({"max_new_tokens": 1, "temperature": 0})
        await self._run([self.eos_ids and min(self.eos_ids) or 0], sp, "health-" + uuid.uuid4().hex, False)
        return web.Response(text="")

    async def model_info(self, request):
        return json_response({"model_path": self.model_path, "tokenizer_path": self.args.tokenizer_path
                      or self.model_path, "is_generation": True, "preferred_sampling_params": None,
                      "weight_version": self.batcher.weight_version, "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": self.model.config.model_type,
                      "architectures": getattr(self.model.config, "architectures", None)})

    async def server_info(self, request):
        return json_response({"version": self.contract_version, "engine": "homegym-hf",
                      "model_path": self.model_path,
                      "context_length": self.max_context_len, "max_context_len": self.max_context_len,
                      "dtype": self.args.dtype, "weight_version": self.batcher.weight_version,
                      "num_running_reqs": self.batcher.num_running, "paused": self.batcher.paused,
                      "num_held_reqs": self._held,
                      "released": self.released_shapes is not None,
                      "decode_steps": self.batcher.steps, **self.batcher.stats,
                      "prefix_cache_hits": self.batcher.prefix_cache.hits,
                      "prefix_cache_hit_tokens": self.batcher.prefix_cache.hit_tokens,
                      "prefix_cache_mb": self.batcher.prefix_cache.bytes / (1 << 20),
                      "gc_frozen_objects": gc.get_freeze_count(), "max_running_requests":
                      self.args.max_running_requests, "api_key_required": bool(self.args.api_key)})

    async def v1_models(self, request):
        return json_response({"object": "list", "data": [{"id": self.model_path, "object": "model",
                                                  "owned_by": "homegym"}]})

    def _flush_if_idle(self) -> bool:
        """On the scheduler thread: clear the prefix cache unless requests are pending
        (SGLang's rule: a flush never drops KV that a request is still using)."""
        if self.batcher.num_running:
            return False
        self.batcher.prefix_cache.clear()
        return True

    async def freeze_gc(self, request):
        """SGLang's ``/freeze_gc`` (0.5.18 entrypoints/http_server.py:1189-1199): what the
        process holds now (torch, the model's modules) leaves the collector's generations,
        so a full collection (a weight release's) walks only what serving made since."""
        gc.freeze()
        return web.Response(text="Garbage collection frozen.\n")

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
        body = await read_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode must be abort, in_place or retract")
        self._unpaused.clear()
        if mode == "abort":
            self.batcher.abort(abort_all=True)
        await self.on_scheduler(lambda: setattr(self.batcher, "paused", True))
        return json_response({"success": True})

    async def continue_generation(self, request):
        self.batcher.paused = False
        self.batcher.wakeup.set()
        self._unpaused.set()
        return json_response({"success": True})

    async def get_weights_by_name(self, request):
        body = await read_body(request)
        name = self._engine_name(body.get("name"))
        if self.args.weight_noise:
            # What it serves is not what it was sent: the sender's check would fail. The
            # client takes this error as "cannot report" and verifies by version only.
            return error_response("weights perturbed by --weight-noise (rollout.weight_noise) are "
                          "not reported", 400)
        sd = self.model.state_dict()
        if name not in sd:
            return error_response("Get parameter by name failed", 400)
        trunc = int(body.get("truncate_size", 100))
        # Slice before the cast: the embedding cast whole is 100+ MB for four rows.
        return json_response(sd[name][:trunc].to(torch.float32).tolist())

    async def begin_weight_update(self, request):
        await read_body(request)
        if self.weight_session:
            return json_response({"success": False, "message": "a weight-update session is already "
                          "open; call end_weight_update() first"}, 400)
        self.weight_session = True
        return json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await read_body(request)
        if not self.weight_session:
            return json_response({"success": False, "message": "no weight-update session is open; "
                          "call begin_weight_update() first"}, 400)
        self.weight_session = False
        return json_response({"success": True, "message": "Success"})

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
            return json_response(await self.on_scheduler(fn))
        except BadRequest as exc:
            return json_response({"success": False, "message": str(exc)}, 400)

    async def update_weights_from_tensor(self, request):
        body = await read_body(request)
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
        body = await read_body(request)
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
        body = await read_body(request)
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
            return json_response({"success": False, "message": f"init_weights_update_group failed: {exc}"}, 400)
        self.groups[name] = pg
        return json_response({"success": True, "message": f"joined {name} as rank {body['rank_offset']}"})

    async def destroy_weights_update_group(self, request):
        body = await read_body(request)
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        if pg is None:
            raise BadRequest(f"no weights update group {name!r}")
        import torch.distributed as dist
        dist.destroy_process_group(pg)
        return json_response({"success": True})

    async def update_weights_from_distributed(self, request):
        import torch.distributed as dist

        body = await read_body(request)
        self._check_session("update_weights_from_distributed")
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED_BUCKET):
            raise BadRequest(f"load_format must be null or {FLATTENED_BUCKET!r} "
                             f"(got {load_format!r})")
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
        try:
            if load_format == FLATTENED_BUCKET:  # one broadcast of the bucket's bytes
                flat, named = broadcast_bucket_views(names, dts, shapes)
                tensors = [flat]
            else:  # one broadcast per tensor
                named = [(n, torch.empty(tuple(s), dtype=d))
                         for n, d, s in zip(names, dts, shapes)]
                tensors = [t for _, t in named]
        except (ValueError, RuntimeError, TypeError) as exc:
            raise BadRequest(f"bad shapes or dtypes: {exc}") from None

        def receive():
            # Receive everything first (the trainer broadcasts it all regardless), then
            # validate and apply, so a mismatch leaves the old weights in place.
            for t in tensors:
                dist.broadcast(t, src=0, group=pg)
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
        tags = self._tags(await read_body(request))

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

        await self.on_scheduler(release)
        # A full collection walks every object not frozen at start (freeze_gc): the whole
        # release took 125-130 ms for SmolLM2 unfrozen, 6-7 ms frozen (Intel Xeon). It only
        # matters when the released weights are big (refcounting frees the rest).
        if sum(s.numel() * d.itemsize for s, d in (self.released_shapes or {}).values()) > 256 << 20:
            gc.collect()
        return json_response(None)

    async def resume_memory(self, request):
        tags = self._tags(await read_body(request))

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
        return json_response(None)


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


async def serve(args: argparse.Namespace, channel_sock: socket.socket,
                control_sock: socket.socket) -> None:
    server = Server(args)
    server.batcher.start()
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, control_sock).start()
    server.channel = await Channel.open(channel_sock, server.on_message, server.front_gone)
    server.channel.send([{"hello": server.info()}])  # the front opens the engine's port
    await asyncio.Event().wait()


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.torch_threads))
    torch.set_num_threads(args.torch_threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # router's HTTP/2 probe
    # The HTTP front (front.py) is forked before the model loads and before any thread
    # starts: it shares this process's imports instead of paying them again.
    control = socket.create_server(("127.0.0.1", 0))
    front_end, scheduler_end = socket.socketpair()
    if os.fork() == 0:
        control_port = control.getsockname()[1]
        control.close()
        scheduler_end.close()
        front.run(args, front_end, control_port, routes(args.contract_version))
    front_end.close()
    try:
        # libuv's event loop: the control server's and the channel's socket and callback
        # work in C rather than asyncio's Python.
        uvloop.run(serve(args, scheduler_end, control))
    except KeyboardInterrupt:
        pass
    except StartupError as exc:
        print(f"homegym: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
