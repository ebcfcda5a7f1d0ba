"""The environment protocol and the registry of environment names (rollout.plugins finds a
class by registered name or dotted path).

One ``Environment`` instance plays one episode: the rollout driver calls ``reset(sample)``
once, then ``step(action_text)`` with each model turn's text until ``done``. Environments
see text only; the driver (rollout/generate.py) owns tokens, masks and budgets.

Contract for ``info``: the driver merges it into ``sample.metadata``, and the manager
averages numeric/bool metadata across a batch into metrics, so keys such as ``success``,
``format_error``, ``turns_taken`` become ``rollout/success_rate`` etc.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Optional

StepResult = tuple[str, float, bool, dict]


class Environment(ABC):
    #: Name in the registry (``env.name`` in the config).
    name: ClassVar[str] = ""

    def __init__(self, max_turns: int = 1, seed: Optional[int] = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 (got {max_turns})")
        self.max_turns = max_turns
        self.seed = seed

    @abstractmethod
    async def reset(self, sample: Any) -> str:
        """Start an episode for ``sample`` (its label holds the task); return the first
        observation. The prompt usually already states the task; the driver only uses this
        text as the prompt when the sample has none."""

    @abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply one model turn; return (observation, reward, done, info).

        The episode's reward is the sum of step rewards."""

    @classmethod
    def dataset(cls, split: str, **kwargs: Any) -> list[dict]:
        """Rows for ``split`` ("train" | "eval") when ``data.path`` is null: dicts with
        ``messages`` (chat messages), ``label`` and optional ``metadata``."""
        raise NotImplementedError(f"{cls.__name__} generates no dataset; set data.path")

    def demo_action(self) -> str:
        """A scripted player's next action (for supervised warm-up transcripts)."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted player")


REGISTRY: dict[str, type[Environment]] = {}
# Built-in environments live in modules imported on first lookup (keeps imports cheap).
BUILTIN_MODULES = {"number_guess": "envs.number_guess", "arithmetic": "envs.arithmetic",
                    "calculator": "envs.calculator"}


def register(name: str) -> Callable[[type[Environment]], type[Environment]]:
    def deco(cls: type[Environment]) -> type[Environment]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered by "
                             f"{REGISTRY[name].__module__}.{REGISTRY[name].__qualname__}")
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco
