"""Talking to the engines: ``post``, ``GenerateState``, the default generate, the env driver.

Request path, kept lean because a step is many tiny requests (64 episodes x 6 turns x ~5
tokens on a 1M-param model, where HTTP/Python overhead dominates): one aiohttp session per
process and event loop, ``input_ids`` (never text), and each turn only *appends* token ids
to the sample -- the growing context is never re-tokenized.

The episode driver is written against a policy, ``async act(token_ids, max_new_tokens) ->
(output_ids, logprobs, finish_type)``: ``EnginePolicy`` calls the engines, and the scripted
players in rollout/demos.py run the very same episode code, so warm-up transcripts have
exactly the token layout of RL rollouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol
from urllib.parse import urlsplit

import aiohttp

from rollout.engines.client import EngineError, backoff_delays, may_retry
from rollout.sample import Sample

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------

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
# The newest weight version any /generate answer reported in this process: stamps samples
# from user generate functions that do not record it themselves.
LAST_WEIGHT_VERSION: list[Optional[int]] = [None]


def _abort_response() -> dict:
    return {"text": "", "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort"}, "prompt_tokens": 0,
                          "completion_tokens": 0, "output_token_logprobs": []}}


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
    session = _SESSIONS.pop(id(asyncio.get_running_loop()), None)
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
    if ABORT.on and url.endswith("/generate"):
        return _abort_response()
    session = get_session()
    name, route = _where(url)
    delays = backoff_delays(max_retries, first_s=0.05, cap_s=2.0)
    for attempt in range(max_retries + 1):
        tries = f" after {attempt + 1} attempts" if attempt else ""
        try:
            async with session.request(method, url, json=payload) as resp:
                if resp.status < 400:
                    if resp.content_type == "application/json":
                        out = await resp.json()
                        if isinstance(out, dict) and "meta_info" in out:
                            version = parse_weight_version(out["meta_info"].get("weight_version"))
                            if version is not None:
                                LAST_WEIGHT_VERSION[0] = version
                        return out
                    body = await resp.text()
                    try:
                        return json.loads(body)
                    except ValueError:
                        return body
                body = await resp.text()
                if attempt == max_retries or not may_retry(method, route, resp.status):
                    raise EngineError(f"{method} {url} -> HTTP {resp.status}{tries}: "
                                      f"{body[:500]}", status=resp.status, engine=name,
                                      route=route)
        # ClientPayloadError: the connection dropped mid-answer (an engine died while
        # streaming its reply through the router): the request is retried, and the
        # router sends it to a live engine.
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                asyncio.TimeoutError) as e:
            connected = not isinstance(e, aiohttp.ClientConnectorError)
            if attempt == max_retries or not may_retry(method, route, None, connected=connected):
                raise EngineError(f"{method} {url}: unreachable{tries}: {e!r}",
                                  engine=name, route=route) from e
        RETRIES["requests"] += 1
        await asyncio.sleep(delays[attempt])
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------
# GenerateState
# --------------------------------------------------------------------------------------

class GenerateState:
    """Per-process generation state: tokenizer, sampling defaults, router URL, semaphore.

    ``GenerateState(args)`` is cheap after the first call (slime-style user code builds it
    on every turn): instances are cached per process by (config object, router); the
    tokenizer is shared by every state of the same model.
    """

    # The cached state holds its config, so the id() in the key cannot be reused.
    _cache: dict[tuple, "GenerateState"] = {}
    _tokenizers: dict[str, Any] = {}

    def __new__(cls, args: Any) -> "GenerateState":
        key = (id(args.config), args.router_url)
        state = cls._cache.get(key)
        if state is None:
            state = super().__new__(cls)
            state._init(args)
            cls._cache[key] = state
        return state

    def __init__(self, args: Any) -> None:  # all work happens once, in _init
        pass

    def _init(self, args: Any) -> None:
        from transformers import AutoTokenizer

        from rollout.models import resolve_model_path

        cfg = args.config
        self.args = args
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        tokenizer = self._tokenizers.get(self.model_path)
        if tokenizer is None:
            tokenizer = self._tokenizers[self.model_path] = AutoTokenizer.from_pretrained(
                self.model_path)
        self.tokenizer = tokenizer
        self.eos_token_id: int = self.tokenizer.eos_token_id
        self.router_url: str = args.router_url
        self.generate_url = f"{self.router_url}/generate"
        self.max_context_len: int = cfg.model.max_context_len
        self.max_concurrency: int = cfg.rollout.max_concurrency
        self.chat_template_kwargs = dict(cfg.data.apply_chat_template_kwargs)
        self.sampling_params = sampling_params_from(cfg.rollout.temperature, cfg.rollout.top_p,
                                                     cfg.rollout.top_k, cfg.rollout.max_response_len,
                                                     list(cfg.rollout.stop))
        self._renderer: Optional[ChatRenderer] = None
        self._semaphores: dict[int, asyncio.Semaphore] = {}

    @property
    def semaphore(self) -> asyncio.Semaphore:
        loop_id = id(asyncio.get_running_loop())
        sem = self._semaphores.get(loop_id)
        if sem is None:
            sem = self._semaphores[loop_id] = asyncio.Semaphore(self.max_concurrency)
        return sem

    @property
    def renderer(self) -> "ChatRenderer":
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self.chat_template_kwargs)
        return self._renderer


def sampling_params_from(temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                         stop: list[str]) -> dict:
    """SGLang sampling params (only keys SGLang knows: user code forwards them verbatim)."""
    params: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                              "max_new_tokens": max_new_tokens}
    if stop:
        params["stop"] = list(stop)
    return params


# --------------------------------------------------------------------------------------
# Rendering environment observations as chat turns
# --------------------------------------------------------------------------------------

class ChatRenderer:
    """Token ids of "a user turn holding an observation, then the assistant's header".

    Derived once from the tokenizer's own chat template (so Qwen3's template, with e.g.
    ``enable_thinking=False`` adding an empty think block, works as well as ChatML):
    a conversation with sentinel texts is rendered and split around the sentinels.
    Per observation only the observation text itself is tokenized.
    """

    _U, _A, _O = "\u2063HGUSER\u2063", "\u2063HGASSISTANT\u2063", "\u2063HGOBS\u2063"

    def __init__(self, tokenizer: Any, chat_template_kwargs: Optional[dict] = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        eos = tokenizer.eos_token
        if eos is None:
            raise ValueError("the tokenizer has no eos_token; multi-turn rendering needs one")
        msgs = [{"role": "user", "content": self._U}, {"role": "assistant", "content": self._A},
                {"role": "user", "content": self._O}]
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **self.kwargs)
        after = full[full.index(self._A) + len(self._A):]
        end = after.find(eos)
        if end < 0:
            raise ValueError(f"the chat template does not end assistant turns with the eos "
                             f"token {eos!r}; cannot render observations token-in/token-out")
        # What closes an assistant turn (normally just eos): used when the model stopped
        # without emitting eos (a stop string).
        self.close_text = after[:end + len(eos)]
        pre, _, post = after[end + len(eos):].partition(self._O)
        self.pre_text, self.post_text = pre, post
        enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        self._enc = enc
        self.close_ids: list[int] = enc(self.close_text)
        self.pre_ids: list[int] = enc(pre)
        self.post_ids: list[int] = enc(post)
        self.eos_token_id: int = tokenizer.eos_token_id
        self._obs_cache: dict[str, list[int]] = {}

    def observation_ids(self, observation: str, model_closed_turn: bool) -> list[int]:
        head = self.pre_ids if model_closed_turn else self.close_ids + self.pre_ids
        # Game observations repeat ("<feedback>higher</feedback>"): encode each text once.
        ids = self._obs_cache.get(observation)
        if ids is None:
            ids = self._enc(observation)
            if len(self._obs_cache) < 4096:
                self._obs_cache[observation] = ids
        return head + ids + self.post_ids

    def prompt_ids(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **self.kwargs)
        return text, self._enc(text)


# --------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------

class Policy(Protocol):
    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]: ...


def parse_weight_version(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class EnginePolicy:
    """The model behind the router: token ids in, output ids + per-token log-probs out."""

    def __init__(self, state: GenerateState, sampling_params: dict) -> None:
        self.state = state
        self.sampling_params = sampling_params
        self.weight_version: Optional[int] = None
        self.versions_mixed = False  # some turn's tokens span a weight update
        self.partial_weights = False  # some forward pass ran on a half-applied update
        self.requests = 0

    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]:
        params = dict(self.sampling_params)
        params["max_new_tokens"] = max_new_tokens
        if params.get("sampling_seed") is not None:
            # A seed per request: one seed for every turn would replay the same random
            # numbers each turn and correlate the turns of an episode. (SGLang's name;
            # sglang-router drops an unknown "seed" on the way to the engine.)
            params["sampling_seed"] = (int(params["sampling_seed"]) + 7_919 * self.requests) % 2**31
        self.requests += 1
        payload = {"input_ids": token_ids, "sampling_params": params, "return_logprob": True}
        async with self.state.semaphore:
            out = await post(self.state.generate_url, payload)
        meta = out.get("meta_info") or {}
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        ids = list(out.get("output_ids") or [])
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise EngineError(f"engine returned {len(ids)} output_ids but {len(lps)} "
                              "output_token_logprobs (was return_logprob honoured?)")
        # The oldest version any of this turn's tokens came from (an update may land
        # mid-request); "+partial" marks a forward pass on half-updated weights.
        seen = meta.get("weight_versions") or [meta.get("weight_version")]
        versions = [v for v in map(parse_weight_version, seen) if v is not None]
        if versions:
            self.weight_version = min(versions)
        if len(set(seen)) > 1:
            self.versions_mixed = True
        if any(str(v).endswith("+partial") for v in seen):
            self.partial_weights = True
        return ids, lps, finish


# --------------------------------------------------------------------------------------
# Episodes
# --------------------------------------------------------------------------------------

@dataclass
class Episode:
    """One sample's progress through an environment; resumable after an abort."""

    sample: Sample
    env: Any = None  # envs.base.Environment, or None for plain single-turn generation
    started: bool = False
    turns: int = 0  # completed model turns
    turn_ids: list[int] = field(default_factory=list)  # the current, unfinished turn
    env_reward: float = 0.0
    weight_versions: list[int] = field(default_factory=list)


def _note_version(episode: Episode, policy: Any) -> None:
    version = getattr(policy, "weight_version", None)
    if version is not None and (not episode.weight_versions or
                                episode.weight_versions[-1] != version):
        episode.weight_versions.append(version)


async def run_episode(episode: Episode, policy: Policy, renderer: ChatRenderer, *,
                      max_turns: int, max_context_len: int, max_response_len: int) -> Sample:
    """Play (or continue) ``episode`` with ``policy``; return its sample.

    Model output ids are appended verbatim (loss mask 1, engine log-probs); observations
    are rendered as chat user turns (loss mask 0, log-prob 0.0). Status: COMPLETED when the
    environment ends the episode, TRUNCATED on a length stop, an exhausted turn budget or
    context budget, ABORTED when the engine aborted (the episode can be continued later).
    """
    s, env = episode.sample, episode.env
    tokenizer = renderer.tokenizer
    if not episode.started:
        if env is not None:
            first_obs = await env.reset(s)
            if not s.tokens:  # no prompt from data: the environment's observation is it
                s.prompt, ids = renderer.prompt_ids([{"role": "user", "content": first_obs}])
                s.tokens = ids
        if not s.tokens:
            raise ValueError(f"sample {s.index}: empty prompt")
        s.set_prompt(s.tokens[:s.prompt_length])
        episode.started = True
    s.status = Sample.Status.PENDING
    eos = renderer.eos_token_id

    while True:
        room = max_context_len - len(s.tokens)
        budget = min(max_response_len - len(episode.turn_ids), room)
        if budget <= 0:
            s.status = Sample.Status.TRUNCATED
            break
        ids, lps, finish = await policy.act(s.tokens, budget)
        s.append(ids, trainable=True, log_probs=lps)
        episode.turn_ids.extend(ids)
        _note_version(episode, policy)
        if finish == "abort":
            s.status = Sample.Status.ABORTED
            return s
        turn_ids, episode.turn_ids = episode.turn_ids, []
        episode.turns += 1
        if env is None:
            s.status = (Sample.Status.TRUNCATED if finish == "length"
                        else Sample.Status.COMPLETED)
            break
        text = tokenizer.decode(turn_ids, skip_special_tokens=True)
        obs, reward, done, info = await env.step(text)
        episode.env_reward += float(reward)
        s.metadata.update(info)
        if finish == "length":
            # Scored anyway (a cut-off answer is usually malformed), so rambling is not
            # rewarded with an unscored episode.
            s.status = Sample.Status.TRUNCATED
            break
        if done:
            s.status = Sample.Status.COMPLETED
            break
        if episode.turns >= max_turns:
            s.status = Sample.Status.TRUNCATED
            break
        closed = bool(turn_ids) and turn_ids[-1] == eos
        obs_ids = renderer.observation_ids(obs, model_closed_turn=closed)
        if len(s.tokens) + len(obs_ids) >= max_context_len:
            s.status = Sample.Status.TRUNCATED
            break
        s.append(obs_ids, trainable=False)

    s.response = tokenizer.decode(s.response_tokens, skip_special_tokens=True)
    s.metadata["num_turns"] = episode.turns
    if episode.weight_versions:
        s.weight_version = min(episode.weight_versions)
    if len(set(episode.weight_versions)) > 1 or getattr(policy, "versions_mixed", False):
        s.metadata["weight_versions_mixed"] = True
    if getattr(policy, "partial_weights", False):
        s.metadata["partial_weight_update"] = True
    if env is not None:
        s.reward = episode.env_reward
    return s


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """The default single-turn generate, token-in/token-out (same shape as a custom one)."""
    state = GenerateState(args)
    if not sample.tokens:
        sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    episode = Episode(sample=sample)
    return await run_episode(episode, EnginePolicy(state, sampling_params), state.renderer,
                             max_turns=1, max_context_len=state.max_context_len,
                             max_response_len=int(sampling_params.get(
                                 "max_new_tokens", state.sampling_params["max_new_tokens"])))
