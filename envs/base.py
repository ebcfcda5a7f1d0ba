"""The environment protocol and the registry of environment names (rollout.plugins finds a
class by registered name or dotted path).

One ``Environment`` instance plays one episode: the rollout driver calls ``reset(sample)``
once, then ``step(action_text)`` with each model turn's text until ``done``. Environments
see text only; the driver (rollout/generate.py) owns tokens, masks and budgets.

Contract for ``info``: the driver merges it into ``sample.metadata``, and the manager
averages numeric/bool metadata across a batch into metrics, so keys such as ``success``,
``format_error``, ``turns_taken`` become ``rollout/success_rate`` etc.

Adapters for the ecosystem's environments (reasoning-gym, OpenEnv, textarena) are
environments like any other; their packages are optional extras, imported through
``require`` so that a missing one is a start-up error naming the extra to install.
"""

from __future__ import annotations

import difflib
import importlib
from abc import ABC, abstractmethod
from types import ModuleType
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

    async def close(self) -> None:
        """Release what the episode holds (a connection, a game). The driver calls it once
        the episode is over, finished or failed; not when it is aborted to be continued."""

    @classmethod
    def check_setup(cls, **kwargs: Any) -> None:
        """Start-up check of what the environment needs from the world (its package, a
        task name, a server), run once before Ray starts with the constructor's keyword
        arguments; raise ``EnvSetupError`` naming the config key to fix."""


class EnvSetupError(ValueError):
    """A problem the user fixes in the config; the message starts with the key
    (``env.task: ...``) and the start-up checks print it as it is."""


def registered(name: Optional[str], names: Any, *, key: str, what: str, example: str) -> str:
    """``name`` if it is one of ``names`` (a package's registry of tasks or games), else an
    EnvSetupError naming ``key`` with the closest names."""
    if not name:
        raise EnvSetupError(f"{key}: must name a {what}, e.g. {example}")
    if name not in names:
        close = difflib.get_close_matches(name, list(names), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else \
            f"{len(names)} of them, e.g. {', '.join(sorted(names)[:5])}"
        raise EnvSetupError(f"{key}: {name!r} is not a {what} ({hint})")
    return name


EVAL_SEED_OFFSET = 1_000_000  # seed rows: eval seeds start here, far from the train split's


def seed_rows(split: str, train_size: int, eval_size: int) -> list[dict]:
    """Rows for environments whose task is a seed: no prompt (the first observation is the
    prompt), the seed as label; train seeds 0..train_size-1, eval seeds from
    EVAL_SEED_OFFSET."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    if train_size < 1 or eval_size < 1:
        raise EnvSetupError("env.kwargs.train_size / eval_size: must be >= 1")
    seeds = range(train_size) if split == "train" else \
        range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + eval_size)
    return [{"messages": None, "label": {"seed": seed}} for seed in seeds]


def require(module: str, *, package: str, extra: str) -> ModuleType:
    """Import an adapter's optional package, or fail naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise EnvSetupError(f"env.name: needs the {package} package, which is not installed "
                            f"({err}); install it with pip install -e '.[{extra}]'") from err


REGISTRY: dict[str, type[Environment]] = {}
# Built-in environments live in modules imported on first lookup (keeps imports cheap).
BUILTIN_MODULES = {"number_guess": "envs.number_guess", "arithmetic": "envs.arithmetic",
                   "calculator": "envs.calculator", "reasoning_gym": "envs.reasoning_gym_tasks",
                   "openenv": "envs.openenv_client", "textarena": "envs.textarena_games"}


def register(name: str) -> Callable[[type[Environment]], type[Environment]]:
    def deco(cls: type[Environment]) -> type[Environment]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered by "
                             f"{REGISTRY[name].__module__}.{REGISTRY[name].__qualname__}")
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco
