"""Several environments in one run: each row's label names the part it comes from.

    python -m trainer.main env=custom env.name=examples.mixed_envs:MixedEnvironments \\
        'env.kwargs.parts=[{name: reasoning_gym, task: chain_sum, max_terms: 2},
                           {name: textarena, id: GuessTheNumber-v0}]' env.max_turns=10

``parts`` lists environments as ``{name, ...their keyword arguments}``: registered names
(the adapters among them) or dotted paths. Each split interleaves the parts' rows round
robin, so every few prompts cover all of them; an episode is played by a fresh instance of
its row's part, which keeps its own tokens, masks, rewards and metrics keys.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, Optional

from envs.base import Environment, StepResult
from rollout.plugins import get_env_class


def _split(part: dict) -> tuple[type[Environment], dict]:
    kwargs = dict(part)
    return get_env_class(kwargs.pop("name")), kwargs


class MixedEnvironments(Environment):
    def __init__(self, max_turns: int = 1, seed: Optional[int] = None,
                 parts: tuple[dict, ...] = ()) -> None:
        super().__init__(max_turns=max_turns, seed=seed)
        if not parts:
            raise ValueError("parts: list the environments to mix, e.g. "
                             "[{name: textarena, id: GuessTheNumber-v0}]")
        self.parts = [_split(p) for p in parts]
        self.env: Optional[Environment] = None

    @classmethod
    def check_setup(cls, parts: tuple[dict, ...] = (), **_: Any) -> None:
        for env_cls, kwargs in map(_split, parts):
            env_cls.check_setup(**kwargs)

    @classmethod
    def dataset(cls, split: str, parts: tuple[dict, ...] = (), **_: Any) -> list[dict]:
        per_part = [[{**row, "label": {"part": i, "label": row.get("label")}}
                     for row in env_cls.dataset(split, **kwargs)]
                    for i, (env_cls, kwargs) in enumerate(map(_split, parts))]
        mixed = itertools.chain.from_iterable(itertools.zip_longest(*per_part))
        return [row for row in mixed if row is not None]

    async def reset(self, sample: Any) -> str:
        part, label = sample.label["part"], sample.label["label"]
        env_cls, kwargs = self.parts[part]
        self.env = env_cls(max_turns=self.max_turns, seed=self.seed, **kwargs)
        return await self.env.reset(SimpleNamespace(label=label))

    async def step(self, action_text: str) -> StepResult:
        return await self.env.step(action_text)

    def demo_action(self) -> str:
        return self.env.demo_action()

    async def close(self) -> None:
        if self.env is not None:
            await self.env.close()
