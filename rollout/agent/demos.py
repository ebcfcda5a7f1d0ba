"""Warm-up transcripts of an agent: the agent itself, against a scripted player.

Each episode runs the configured agent through a real session whose policy is
``ScriptedChatPolicy`` (rollout.agent.demo_function's replies), so a transcript has the
token layout, chat rendering and loss mask of the agent's RL rollouts -- tool calls, tool
results and all.
"""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any, Sequence

from rollout.plugins import load_object
from rollout.agent import ScriptedChatPolicy, run_agent
from rollout.args import RolloutArgs, load_plugin
from rollout.data import DataSource
from rollout.sample import Sample

# Demo episodes in flight at once: enough to overlap the HTTP round trips, few enough
# that the openai client's connection pool does not churn.
_CONCURRENCY = 32
# Each episode is a few real openai-client round trips (milliseconds each): a warm-up of
# steps x batch_size transcripts replays at most this many distinct episodes, in epochs.
MAX_DISTINCT_EPISODES = 1024


async def play_agent_demos(tokenizer: Any, num_samples: int, *, model: Any, rollout: Any,
                           data: Any, env: Any, seed: int = 0,
                           splits: Sequence[str] = ("train",)) -> list[Sample]:
    a = rollout.agent
    if not a.demo_function:
        raise ValueError("warm-up with rollout.agent.function needs rollout.agent.demo_function"
                         " (the scripted player), or warmup.steps=0")
    agent = load_plugin(a.function, "rollout.agent.function")
    reply = load_object(a.demo_function, "rollout.agent.demo_function")
    # The agent gets the args object it gets in RL; no router is involved here.
    args = RolloutArgs("http://127.0.0.1:1", model=model, rollout=rollout, data=data, env=env)
    sources = []
    for split in splits:
        source = DataSource.for_split(split, tokenizer, data=data, env=env,
                                      n_samples_per_prompt=1)
        source.reseed(seed)
        sources.append(source)
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(k: int, sample: Sample) -> list[Sample]:
        policy = ScriptedChatPolicy(reply, sample, tokenizer, random.Random(seed * 1_000_003 + k))
        async with sem:
            return await run_agent(agent, args, sample, policy, tokenizer=tokenizer,
                                   max_new_tokens=rollout.max_response_len,
                                   max_context_len=model.max_context_len,
                                   chat_template_kwargs=data.apply_chat_template_kwargs,
                                   history_policy=a.history_policy,
                                   timeout=rollout.sample_timeout_s)

    distinct = min(num_samples, MAX_DISTINCT_EPISODES)
    groups = [sources[k % len(sources)].next_group()[0] for k in range(distinct)]
    results = await asyncio.gather(*(one(k, s) for k, s in enumerate(groups)))
    episodes = [s for episode in results for s in episode]
    order = random.Random(seed)
    out: list[Sample] = []
    while len(out) < num_samples:  # further epochs in fresh orders
        out += [copy.deepcopy(s) for s in (episodes if not out else
                                           order.sample(episodes, len(episodes)))]
    return out[:num_samples]
