"""Generating samples: ``GenerateState``, the engine policy, the episode driver and the
default generate.

The episode driver is written against a policy, ``async act(token_ids, max_new_tokens) ->
(output_ids, logprobs, finish_type)``: ``EnginePolicy`` calls the engines (through
rollout.http's ``post``), and the scripted players in rollout/demos.py run the very same
episode code, so warm-up transcripts have exactly the token layout of RL rollouts. Each
turn only *appends* token ids to the sample: the growing context is never re-tokenized.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from rollout.chat import ChatRenderer, load_tokenizer
from rollout.engines.client import EngineError
from rollout.http import generate_together, parse_weight_version, post
from rollout.sample import Sample

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# GenerateState
# --------------------------------------------------------------------------------------

class GenerateState:
    """Per-process generation state: tokenizer, sampling defaults, router URL, semaphore.

    ``GenerateState(args)`` is cheap after the first call (slime-style user code builds it
    on every turn): instances are cached per process by (config sections, router); the
    tokenizer is shared by every state of the same model.
    """

    # The cached state holds its args (so its sections), so the id()s in the key cannot be
    # reused.
    _cache: dict[tuple, "GenerateState"] = {}

    def __new__(cls, args: Any) -> "GenerateState":
        key = (id(args.model), id(args.rollout), id(args.data), args.router_url)
        state = cls._cache.get(key)
        if state is None:
            state = super().__new__(cls)
            state._init(args)
            cls._cache[key] = state
        return state

    def __init__(self, args: Any) -> None:  # all work happens once, in _init
        pass

    def _init(self, args: Any) -> None:
        from rollout.models import resolve_model_path

        model, rollout = args.model, args.rollout
        self.args = args
        self.model_path = resolve_model_path(model.path, model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_id: int = self.tokenizer.eos_token_id
        self.router_url: str = args.router_url
        self.generate_url = f"{self.router_url}/generate"
        self.max_context_len: int = model.max_context_len
        self.max_concurrency: int = rollout.max_concurrency
        self.batch_turns_up_to: int = rollout.batch_turns_up_to
        self.chat_template_kwargs = dict(args.data.apply_chat_template_kwargs)
        self.sampling_params = sampling_params_from(rollout.temperature, rollout.top_p,
                                                     rollout.top_k, rollout.max_response_len,
                                                     list(rollout.stop))
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
    def renderer(self) -> ChatRenderer:
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
# Policies
# --------------------------------------------------------------------------------------

class Policy(Protocol):
    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]: ...


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
        # A short turn shares one request with the others ready now (rollout.batch_turns_up_to).
        send = generate_together if max_new_tokens <= self.state.batch_turns_up_to else post
        async with self.state.semaphore:
            out = await send(self.state.generate_url, payload)
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
    env_closed: bool = False


def _note_version(episode: Episode, policy: Any) -> None:
    version = getattr(policy, "weight_version", None)
    if version is not None and (not episode.weight_versions or
                                episode.weight_versions[-1] != version):
        episode.weight_versions.append(version)


async def close_episode(episode: Episode) -> None:
    """Let the episode's environment release what it holds (a session, a game); a failure
    to do so is logged, never the sample's failure."""
    env = episode.env
    if env is None or episode.env_closed:
        return
    episode.env_closed = True
    try:
        await env.close()
    except Exception as err:
        logger.warning("sample %s: closing its environment failed: %s: %s",
                       episode.sample.index, type(err).__name__, err)


async def run_episode(episode: Episode, policy: Policy, renderer: ChatRenderer, *,
                      max_turns: int, max_context_len: int, max_response_len: int) -> Sample:
    """Play (or continue) ``episode`` with ``policy``; return its sample.

    Model output ids are appended verbatim (loss mask 1, engine log-probs); observations
    are rendered as chat user turns (loss mask 0, log-prob 0.0). Status: COMPLETED when the
    environment ends the episode, TRUNCATED on a length stop, an exhausted turn budget or
    context budget, ABORTED when the engine aborted (the episode can be continued later).
    The environment is closed once the episode is over (finished, or failed by an
    exception), not when it is aborted.
    """
    try:
        s = await _play(episode, policy, renderer, max_turns=max_turns,
                        max_context_len=max_context_len, max_response_len=max_response_len)
    except BaseException:
        await close_episode(episode)
        raise
    if s.status != Sample.Status.ABORTED:
        await close_episode(episode)
    return s


async def _play(episode: Episode, policy: Policy, renderer: ChatRenderer, *,
                max_turns: int, max_context_len: int, max_response_len: int) -> Sample:
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
