"""Supervised warm-up transcripts from an environment's scripted players.

The scripted player is just another policy for ``rollout.generate.run_episode``: its text is
tokenized and closed with eos, exactly where the model's own output ids would go. So an SFT
transcript has the same token layout, chat rendering and loss mask as an RL rollout of the
same game -- the warm-up teaches precisely the format RL later samples.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from envs.base import Environment
from rollout.plugins import get_env_class
from rollout.data import DataSource
from rollout.chat import ChatRenderer
from rollout.generate import Episode, run_episode
from rollout.sample import Sample


class ScriptedPolicy:
    """Plays ``env.demo_action()`` each turn: scripted text tokens + eos, log-prob 0."""

    def __init__(self, env: Environment, tokenizer: Any) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.weight_version = None

    async def act(self, token_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], list[float], str]:
        text = self.env.demo_action()
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        return ids, [0.0] * len(ids), finish


async def play_demos(tokenizer: Any, num_samples: int, *, model: Any, rollout: Any, data: Any,
                     env: Any, seed: int = 0, splits: Sequence[str] = ("train",),
                     renderer: Optional[ChatRenderer] = None) -> list[Sample]:
    """``num_samples`` scripted episodes over the prompts of ``splits`` (each split cycled
    in a shuffled order of its own; episodes alternate between the splits)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (got {num_samples})")
    if not splits:
        raise ValueError("play_demos: splits is empty")
    if rollout.agent.function:  # an OpenAI-API agent plays against the script
        from rollout.agent.demos import play_agent_demos

        return await play_agent_demos(tokenizer, num_samples, model=model, rollout=rollout,
                                      data=data, env=env, seed=seed, splits=splits)
    env_cls = get_env_class(env.name)
    sources = []
    for split in splits:
        source = DataSource.for_split(split, tokenizer, data=data, env=env,
                                      n_samples_per_prompt=1)
        source.reseed(seed)  # a shuffled order of its own, whatever data.shuffle says
        sources.append(source)
    renderer = renderer or ChatRenderer(tokenizer, data.apply_chat_template_kwargs)
    samples = []
    for k in range(num_samples):
        sample = sources[k % len(sources)].next_group()[0]
        # Each episode its own env seed, so the player mix and random guesses vary.
        game = env_cls(max_turns=env.max_turns, seed=seed * 1_000_003 + k, **env.init_kwargs)
        episode = Episode(sample=sample, env=game)
        samples.append(await run_episode(
            episode, ScriptedPolicy(game, tokenizer), renderer,
            max_turns=env.max_turns, max_context_len=model.max_context_len,
            max_response_len=rollout.max_response_len))
    return samples


def make_demos(tokenizer: Any, num_samples: int, *, model: Any, rollout: Any, data: Any,
               env: Any, seed: int = 0, splits: Sequence[str] = ("train",)) -> list[Sample]:
    """Synchronous ``play_demos`` for the warm-up trainer (no engine involved)."""
    return asyncio.run(play_demos(tokenizer, num_samples, model=model, rollout=rollout,
                                  data=data, env=env, seed=seed, splits=splits))
