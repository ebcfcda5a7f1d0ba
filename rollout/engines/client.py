"""The admin side of SGLang's HTTP contract, as one client for every engine kind.

homegym supports exactly the SGLang versions in ``SUPPORTED_SGLANG_VERSIONS``; the CPU
engine (rollout/engines/hf) serves the pinned one's contract. The client asks a server its
version once (``/get_server_info`` -> ``version``) and refuses any other, so a version
whose routes homegym has not been checked against (tests/test_sglang_contract.py reads
each supported wheel's own source) fails at start-up, not in the middle of a run.

What differs between the supported versions, and is handled here:
- 0.5.23 refuses ``update_weights_from_tensor`` / ``_from_distributed`` outside a session
  opened by ``/begin_weight_update`` and closed by ``/end_weight_update``
  (``weight_update_session``); 0.5.18 has no such routes.
Both: the served weight version is ``/model_info``'s ``weight_version``
(``/get_weight_version`` is a 404); unknown request keys are dropped silently, so nothing
homegym-only is ever sent; a weight update with ``flush_cache: true`` fails (0.5.23) or
kills the scheduler (0.5.18, an assert) when any request is queued, so updates never flush
and the caller flushes once after the update (``flush_cache``: SGLang's deferred flush,
which runs as soon as the server is idle; trainer/weight_sync/engine_updates.py says when).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import requests

PINNED_SGLANG_VERSION = "0.5.18"
SUPPORTED_SGLANG_VERSIONS = ("0.5.18", "0.5.23")
# Versions whose tensor/distributed weight updates must run inside a session.
_SESSION_VERSIONS = frozenset({"0.5.23"})


T = TypeVar("T")


def fan_out(fn: Callable[[Any], T], items: Iterable[Any],
            pool: Optional[ThreadPoolExecutor] = None) -> list[T]:
    """``fn(item)`` for every item (e.g. every engine's client) at once, on a thread each
    (in the calling thread when there is one item), or on ``pool``: the results in item
    order once every call has returned; if any failed, the first failure in item order is
    raised after all have finished, so no call is left running."""
    items = list(items)
    if len(items) <= 1 and pool is None:
        return [fn(item) for item in items]
    if pool is None:
        with ThreadPoolExecutor(max_workers=len(items)) as own:
            futures = [own.submit(fn, item) for item in items]
    else:
        futures = [pool.submit(fn, item) for item in items]
        concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class EngineError(RuntimeError):
    """An engine or the router answered with an error, or stayed unreachable.

    ``status`` is the HTTP status (None when unreachable); ``engine`` and ``route`` say
    where, so a failure in a fan-out over many engines names the one that failed."""

    def __init__(self, message: str, *, status: Optional[int] = None,
                 engine: Optional[str] = None, route: Optional[str] = None):
        where = " ".join(p for p in (engine, route) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.status, self.engine, self.route, self.message = status, engine, route, message


class UnsupportedEngineVersion(EngineError):
    pass


# Requests that may be sent again after a failure, whatever the server did with the first:
# a /generate restarts its sample (a fresh draw; a partial rollout keeps only tokens it was
# answered), and the others only read, abort or set a state that a repeat leaves as it is.
# Weight updates, memory release/resume and group formation are not among them: a repeat
# can load half a version or join a group twice, so the caller decides (the driver re-does
# a whole push after restarting a dead engine).
IDEMPOTENT_ROUTES = frozenset({
    "/generate", "/v1/chat/completions", "/v1/completions", "/abort_request",
    "/pause_generation", "/continue_generation", "/flush_cache", "/get_weights_by_name"})
RETRY_STATUS = frozenset({500, 502, 503, 504})


def may_retry(method: str, route: str, status: Optional[int], *, connected: bool = True) -> bool:
    """Whether a failed request is worth sending again. ``status`` None: no answer (the
    connection failed; ``connected`` False when it was never established, so nothing was
    sent). Idempotent requests are retried on any 5xx and connection failure; the rest only
    where the server cannot have acted on them: no connection, or 503 (the server or the
    router in front of it refused the request as unavailable, without forwarding it)."""
    if method.upper() == "GET" or route in IDEMPOTENT_ROUTES:
        return status is None or status in RETRY_STATUS
    return (status is None and not connected) or status == 503


def backoff_delays(max_retries: int, *, first_s: float, cap_s: float) -> list[float]:
    """Exponential backoff with full jitter on top (so many samples retrying at once after
    an engine died do not return together)."""
    import random

    delays, delay = [], first_s
    for _ in range(max_retries):
        delays.append(delay * (1 + random.random()))
        delay = min(delay * 2, cap_s)
    return delays


class Retry:
    """The attempts of one request, for both HTTP clients (EngineClient.call, rollout.http.
    post): after a failure, ``next_delay`` is the seconds to wait before sending it again,
    or None when it must not be repeated (``may_retry``) or the retries are spent."""

    def __init__(self, max_retries: int, *, first_s: float, cap_s: float) -> None:
        self.delays = backoff_delays(max_retries, first_s=first_s, cap_s=cap_s)
        self.retries = 0  # made so far

    def next_delay(self, method: str, route: str, status: Optional[int], *,
                   connected: bool = True) -> Optional[float]:
        if self.retries == len(self.delays) or not may_retry(method, route, status,
                                                             connected=connected):
            return None
        self.retries += 1
        return self.delays[self.retries - 1]

    @property
    def attempts(self) -> int:
        return self.retries + 1


def check_version(version: str, *, engine: str = "engine") -> str:
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedEngineVersion(
            f"serves SGLang {version!r}; homegym supports SGLang "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (pinned: {PINNED_SGLANG_VERSION}). "
            f"Install one of them (pip install sglang=={PINNED_SGLANG_VERSION})", engine=engine)
    return version


class EngineClient:
    """HTTP admin calls to one engine (SGLang, or homegym's CPU engine serving its contract).

    Usable anywhere a URL is reachable: the engine's supervising actor, a training rank
    that streams weights to the engines, a test."""

    def __init__(self, url: str, api_key: Optional[str] = None, *, name: str = "engine",
                 timeout_s: float = 600.0, max_retries: int = 3,
                 version: Optional[str] = None):
        self.url = url.rstrip("/")
        self.name = name
        self.timeout_s = timeout_s
        self.api_key = api_key
        # Few, short retries (about 1 s in all): an engine that is down stays down until the
        # driver restarts it, and a fan-out should fail fast naming it.
        self.max_retries = max_retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = requests.Session()
        # The SGLang version the server reports, once asked (or handed over by a process
        # that asked: each push's clients on the training ranks would otherwise ask again).
        self._version: Optional[str] = version
        self._weights_by_name: Optional[bool] = None  # None: not asked yet

    def __getstate__(self) -> dict:  # shipped to Ray actors: a Session does not pickle
        state = dict(self.__dict__)
        state.pop("session")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.session = requests.Session()

    # ---- plumbing ----
    def call(self, route: str, payload: Optional[dict] = None, *, method: str = "POST",
             timeout_s: Optional[float] = None, params: Optional[dict] = None) -> Any:
        """One admin request; retried with backoff where ``may_retry`` allows, else (or
        once the retries are spent) an EngineError naming this engine and the route."""
        retry = Retry(self.max_retries, first_s=0.1, cap_s=1.0)
        while True:
            try:
                r = self.session.request(method, self.url + route, json=payload, params=params,
                                         headers=self.headers, timeout=timeout_s or self.timeout_s)
            except requests.RequestException as err:
                connected = not isinstance(err, requests.exceptions.ConnectTimeout) and not (
                    isinstance(err, requests.ConnectionError)
                    and "Connection refused" in str(err))
                delay = retry.next_delay(method, route, None, connected=connected)
                if delay is not None:
                    time.sleep(delay)
                    continue
                tries = f" after {retry.attempts} attempts" if retry.retries else ""
                raise EngineError(f"unreachable at {self.url}{tries}: {err}", engine=self.name,
                                  route=route) from err
            try:
                data = r.json()
            except ValueError:
                data = r.text
            failed = isinstance(data, dict) and data.get("success") is False
            if r.status_code < 300 and not failed:
                return data
            delay = retry.next_delay(method, route, r.status_code)
            if delay is not None:
                time.sleep(delay)
                continue
            tries = f" (after {retry.attempts} attempts)" if retry.retries else ""
            raise EngineError(f"HTTP {r.status_code}{tries}: {_message(data)}",
                              status=r.status_code, engine=self.name, route=route)

    # ---- version ----
    def server_info(self) -> dict:
        return self.call("/server_info", method="GET")

    def version(self) -> str:
        """The SGLang version the server reports, checked against the supported ones."""
        if self._version is None:
            self._version = check_version(str(self.server_info().get("version")), engine=self.name)
        return self._version

    @property
    def uses_weight_update_sessions(self) -> bool:
        return self.version() in _SESSION_VERSIONS

    # ---- weights ----
    @contextlib.contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """Wrap tensor/distributed updates: a session where the server needs one (0.5.23),
        nothing where it has none. The session is closed even when an update fails."""
        if not self.uses_weight_update_sessions:
            yield
            return
        self.call("/begin_weight_update", {})
        try:
            yield
        finally:
            self.call("/end_weight_update", {})

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *,
                                   load_format: Optional[str] = None,
                                   version: Optional[Any] = None) -> dict:
        """``serialized_named_tensors``: one payload per engine TP rank
        (rollout.engines.weights_io)."""
        body: dict = {"serialized_named_tensors": list(serialized_named_tensors),
                      "load_format": load_format, "flush_cache": False}
        if version is not None:
            body["weight_version"] = str(version)
        return self.call("/update_weights_from_tensor", body)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> dict:
        return self.call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend})

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self.call("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names, dtypes, shapes, *, group_name: str,
                                        version: Optional[Any] = None,
                                        load_format: Optional[str] = None) -> dict:
        """``load_format="flattened_bucket"``: the tensors come as one broadcast of their
        bytes back to back (``weights_io.broadcast_bucket``); otherwise one each."""
        body: dict = {"names": list(names),
                      "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                      "shapes": [list(s) for s in shapes], "group_name": group_name,
                      "flush_cache": False}
        if version is not None:
            body["weight_version"] = str(version)
        if load_format is not None:
            body["load_format"] = load_format
        return self.call("/update_weights_from_distributed", body)

    def update_weights_from_disk(self, model_path: str, *, version: Optional[Any] = None) -> dict:
        body: dict = {"model_path": model_path, "flush_cache": False}
        if version is not None:
            body["weight_version"] = str(version)
        return self.call("/update_weights_from_disk", body)

    def weight_version(self) -> str:
        return str(self.call("/model_info", method="GET")["weight_version"])

    def update_weight_version(self, version: Any) -> dict:
        """Set the reported weight version without touching the weights (an adapter push);
        requests in flight are left alone."""
        return self.call("/update_weight_version",
                         {"new_version": str(version), "abort_all_requests": False})

    # ---- LoRA adapters (a server started with --enable-lora) ----
    def load_lora_adapter(self, name: str, path: str) -> dict:
        """Load the peft adapter directory ``path`` (readable by the server) as ``name``;
        the answer's ``loaded_adapters`` maps every loaded name to its path."""
        return self.call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora_adapter(self, name: str) -> dict:
        """Unregister ``name``; the server frees it once its requests in flight finish."""
        return self.call("/unload_lora_adapter", {"lora_name": name})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Optional[list]:
        """The first ``truncate_size`` rows of one weight, or None where the server cannot
        report weights by name (SGLang implements it for some model classes only, e.g.
        Llama but not Qwen3 in 0.5.18: it answers an error then)."""
        if self._weights_by_name is False:
            return None
        try:
            out = self.call("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        except EngineError:
            # Until one answer succeeds, an error means the server cannot report weights.
            # Not `is None`: read_back asks for several names at once, and a call that fails
            # after another call's failure set False must not raise.
            if not self._weights_by_name:
                self._weights_by_name = False
                return None
            raise
        self._weights_by_name = True
        return out.get("parameter", out) if isinstance(out, dict) else out

    def flush_cache(self, timeout_s: float = 120.0) -> None:
        """Flush the prefix cache as soon as no request is queued or running, waiting at
        most ``timeout_s``: SGLang's deferred flush, ``/flush_cache?timeout=``
        (0.5.18 entrypoints/http_server.py:966-981, scheduler_components/flush_wrapper.py;
        0.5.23 the same). A request held by a paused server is not in its scheduler and
        does not delay it. EngineError when the server stays busy that long."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(deadline - time.monotonic(), 1e-3)
            try:
                self.call("/flush_cache", method="GET", params={"timeout": left},
                          timeout_s=left + 60)
                return
            except EngineError as err:
                # One deferred flush per server at a time: another caller's is waiting.
                if "already in progress" not in err.message or time.monotonic() >= deadline:
                    raise
            time.sleep(0.05)

    def freeze_gc(self) -> None:
        """Move every object the server holds now out of the garbage collector's reach
        (``gc.freeze``), so later collections walk only what serving creates. SGLang
        0.5.18 asks itself after its warm-up, but with the warm-up skipped the request
        races its HTTP server's start and in some starts fails; on CPU each flush and
        memory release then runs a full collection over torch's and SGLang's objects
        (~0.35 s, two per colocated step, Intel Xeon)."""
        self.call("/freeze_gc")

    # ---- memory and generation control ----
    def release_memory(self, tags: Optional[list[str]] = None) -> dict:
        return self.call("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: Optional[list[str]] = None) -> dict:
        return self.call("/resume_memory_occupation", {"tags": tags})

    def pause_generation(self, mode: str = "abort") -> dict:
        return self.call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self.call("/continue_generation", {})

    def abort_all(self) -> dict:
        return self.call("/abort_request", {"abort_all": True})


def _message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(data.get("message") or err or data.get("detail") or data)
    return str(data)[:1000]
