"""HTTP to the router and engines on the rollout path: ``post`` (retries, the abort switch)
and ``generate_together`` (concurrent short /generate calls as one batched request).

Kept lean because a step is many tiny requests (64 episodes x 6 turns x ~5 tokens on a
1M-param model, where HTTP/Python overhead dominates): one aiohttp session per process and
event loop, callers send ``input_ids`` (never text), and short turns that are ready
together share one request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional
from urllib.parse import urlsplit

import aiohttp

from rollout.engines.client import EngineError, Retry

_SESSIONS: dict[int, aiohttp.ClientSession] = {}
# Names for base URLs in error messages (the manager names its router); others read host:port.
ENDPOINT_NAMES: dict[str, str] = {}
# Requests of this process sent again after a failure (the manager reports it per step).
RETRIES = {"requests": 0}


class _AbortSwitch:
    """Process-wide "the step is over" switch. While on, ``post`` answers /generate with an
    abort response without sending it, so episodes (built-in or user code) that are between
    turns when the manager aborts stop at their next request instead of slipping past
    ``abort_request``."""

    on = False


ABORT = _AbortSwitch()


class _GenerateGate:
    """Process-wide hold on new engine calls while a weight update's flush is pending.

    A disaggregated push with ``rollout.update_in_flight=pause`` lets the requests in
    flight finish on the new weights, and the engines' prefix cache then holds KV of the
    old ones until it is flushed, which SGLang does only on an idle engine. While held,
    ``post`` keeps every new /generate back, so none is served from that KV
    (trainer/weight_sync/engine_updates.py closes and opens it through the rollout manager)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()


GATE = _GenerateGate()
# The newest weight version any /generate answer reported in this process: stamps samples
# from user generate functions that do not record it themselves.
LAST_WEIGHT_VERSION: list[Optional[int]] = [None]
# The LoRA adapter the engines serve the current policy as (train.lora.push=adapter; set
# by the manager after each push): SGLang applies an adapter only to requests that name
# it, so ``post`` adds it as ``lora_path`` to every /generate that names none.
LORA_ADAPTER: list[Optional[str]] = [None]


def _abort_response() -> dict:
    return {"text": "", "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort"}, "prompt_tokens": 0,
                          "completion_tokens": 0, "output_token_logprobs": []}}


def _note_weight_version(out: Any) -> None:
    if isinstance(out, dict) and "meta_info" in out:
        version = parse_weight_version(out["meta_info"].get("weight_version"))
        if version is not None:
            LAST_WEIGHT_VERSION[0] = version


def get_session() -> aiohttp.ClientSession:
    """The aiohttp session of the running event loop (a session is bound to its loop)."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(id(loop))
    if session is None or session.closed:
        # limit=0: concurrency is bounded by GenerateState's semaphore, not the pool.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        session = aiohttp.ClientSession(connector=connector,
                                        timeout=aiohttp.ClientTimeout(total=None))
        _SESSIONS[id(loop)] = session
    return session


async def close_session() -> None:
    loop_id = id(asyncio.get_running_loop())
    _TOGETHER.pop(loop_id, None)
    session = _SESSIONS.pop(loop_id, None)
    if session is not None:
        await session.close()


def _where(url: str) -> tuple[str, str]:
    """(endpoint name, route) of ``url``, for error messages."""
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}"
    return ENDPOINT_NAMES.get(base, parts.netloc), parts.path or "/"


async def post(url: str, payload: Optional[dict] = None, *, max_retries: int = 8,
               method: str = "POST") -> Any:
    """POST JSON and return the decoded JSON answer (or text when it is not JSON).

    Failures are retried with exponential backoff and jitter where repeating the request
    is safe (``rollout.engines.client.may_retry``): a /generate on any 5xx or dropped
    connection -- an engine that dies mid-request costs a retry on another engine, not
    the sample -- and any request that never reached a server (refused connection, 503).
    Otherwise, or once the retries are spent, ``EngineError`` names the engine (or router)
    and route, with the status and the server's message.
    """
    if url.endswith("/generate"):
        await GATE.wait()  # returns at once while the gate is open
        if ABORT.on:
            return _abort_response()
    if LORA_ADAPTER[0] is not None and url.endswith("/generate") and isinstance(payload, dict) \
            and payload.get("lora_path") is None:
        payload = {**payload, "lora_path": LORA_ADAPTER[0]}
    session = get_session()
    name, route = _where(url)
    retry = Retry(max_retries, first_s=0.05, cap_s=2.0)
    while True:
        tries = f" after {retry.attempts} attempts" if retry.retries else ""
        try:
            async with session.request(method, url, json=payload) as resp:
                if resp.status < 400:
                    if resp.content_type == "application/json":
                        out = await resp.json()
                        for answer in (out if isinstance(out, list) else [out]):
                            _note_weight_version(answer)
                        return out
                    body = await resp.text()
                    try:
                        return json.loads(body)
                    except ValueError:
                        return body
                body = await resp.text()
                delay = retry.next_delay(method, route, resp.status)
                if delay is None:
                    raise EngineError(f"{method} {url} -> HTTP {resp.status}{tries}: "
                                      f"{body[:500]}", status=resp.status, engine=name,
                                      route=route)
        # ClientPayloadError: the connection dropped mid-answer (an engine died while
        # streaming its reply through the router): the request is retried, and the
        # router sends it to a live engine.
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.TimeoutError) as e:
            connected = not isinstance(e, aiohttp.ClientConnectorError)
            delay = retry.next_delay(method, route, None, connected=connected)
            if delay is None:
                raise EngineError(f"{method} {url}: unreachable{tries}: {e!r}",
                                  engine=name, route=route) from e
        RETRIES["requests"] += 1
        await asyncio.sleep(delay)



def parse_weight_version(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class _Together:
    """The /generate calls of one event loop that are ready at the same moment, grouped by
    everything but their ``input_ids`` and sent as one batched request per group at the
    loop's next turn (SGLang's batch form: a list of ``input_ids``, one ``sampling_params``;
    sglang-router passes it through, and answers come back as a list in the same order)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: dict[tuple[str, str], tuple[dict, list]] = {}
        self.sending: set[asyncio.Task] = set()  # the loop keeps only weak references

    def add(self, url: str, payload: dict) -> asyncio.Future:
        rest = {k: v for k, v in payload.items() if k != "input_ids"}
        key = (url, json.dumps(rest, sort_keys=True))
        if not self.pending:
            self.loop.call_soon(self._flush)
        future = self.loop.create_future()
        self.pending.setdefault(key, (rest, []))[1].append((payload["input_ids"], future))
        return future

    def _flush(self) -> None:
        pending, self.pending = self.pending, {}
        for (url, _), (rest, items) in pending.items():
            task = self.loop.create_task(self._send(url, rest, items))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _send(self, url: str, rest: dict, items: list) -> None:
        try:
            if len(items) == 1:
                answers = [await post(url, {**rest, "input_ids": items[0][0]})]
            else:
                answers = await self._batch(url, rest, [ids for ids, _ in items])
        except Exception as err:  # the callers raise it, as they would their own request's
            for _, future in items:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), answer in zip(items, answers):
            if not future.done():  # a caller that was cancelled (timed out) is gone
                future.set_result(answer)

    async def _batch(self, url: str, rest: dict, prompts: list) -> list:
        try:
            answers = await post(url, {**rest, "input_ids": prompts})
        except EngineError as err:
            if err.status is None or not 400 <= err.status < 500:
                raise
            # One prompt the engine refuses (e.g. too long) fails only its own call.
            return await asyncio.gather(*[post(url, {**rest, "input_ids": ids})
                                          for ids in prompts], return_exceptions=True)
        if isinstance(answers, dict):  # the abort switch's answer stands for every prompt
            return [answers] * len(prompts)
        if not isinstance(answers, list) or len(answers) != len(prompts):
            raise EngineError(f"POST {url}: {len(prompts)} prompts in one request, but the "
                              f"answer is not a list of {len(prompts)}: {str(answers)[:200]}")
        return answers


_TOGETHER: dict[int, _Together] = {}


async def generate_together(url: str, payload: dict) -> Any:
    """``post(url, payload)`` for a /generate of one prompt, sent in one request with the
    other such calls of this event loop that are ready at the same time and differ only in
    their prompts (e.g. a wave of episodes whose turns all came back together). Each HTTP
    request costs ~1 ms of CPU over the client, the router and the engine's front, more
    than a short turn's generation on a small model; a batch answers when its longest
    prompt is done, so long turns are better sent alone. An engine's 4xx for the batch is
    retried prompt by prompt, so it fails only the prompt it is about."""
    loop = asyncio.get_running_loop()
    together = _TOGETHER.get(id(loop))
    if together is None or together.loop is not loop:
        together = _TOGETHER[id(loop)] = _Together(loop)
    answer = await together.add(url, payload)
    if isinstance(answer, BaseException):
        raise answer
    return answer
