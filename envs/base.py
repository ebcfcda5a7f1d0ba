"""The environment protocol, and finding an environment class by name or dotted path.

One ``Environment`` instance plays one episode: the rollout driver calls ``reset(sample)``
once, then ``step(action_text)`` with each model turn's text until ``done``. Environments
see text only; the driver (rollout/generate.py) owns tokens, masks and budgets.

Contract for ``info``: the driver merges it into ``sample.metadata``, and the manager
averages numeric/bool metadata across a batch into metrics, so keys such as ``success``,
``format_error``, ``turns_taken`` become ``rollout/success_rate`` etc.
"""

from __future__ import annotations

import importlib
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


_REGISTRY: dict[str, type[Environment]] = {}
# Built-in environments live in modules imported on first lookup (keeps imports cheap).
_BUILTIN_MODULES = {"number_guess": "envs.number_guess", "arithmetic": "envs.arithmetic",
                    "calculator": "envs.calculator"}


def register(name: str) -> Callable[[type[Environment]], type[Environment]]:
    def deco(cls: type[Environment]) -> type[Environment]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is already registered by "
                             f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def load_object(path: str, what: str = "object") -> Any:
    """Import ``package.module:attr`` or ``package.module.attr``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as e:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from e
    return obj


def get_env_class(name: str) -> type[Environment]:
    """A registered environment name (number_guess, arithmetic) or a dotted class path."""
    if name in _BUILTIN_MODULES and name not in _REGISTRY:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in _REGISTRY:
        return _REGISTRY[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"env.name: unknown environment {name!r}; registered: "
                         f"{', '.join(sorted(set(_REGISTRY) | set(_BUILTIN_MODULES)))}, "
                         "or give a dotted path to an Environment subclass")
    cls = load_object(name, "env.name")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.name: {name!r} is not an envs.base.Environment subclass")
    return cls
