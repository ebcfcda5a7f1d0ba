"""Dynamic-sampling filters by registered name (``rollout.dynamic_sampling_filter``): keep a
finished group (True) or drop it (False), ``filter(args, samples)``."""

from __future__ import annotations

from typing import Any, Callable

from rollout.sample import Sample


def nonzero_std(args: Any, samples: list[Sample]) -> bool:
    """DAPO's filter: keep a group only if its rewards differ (else no learning signal)."""
    rewards = [s.scalar_reward for s in samples]
    return max(rewards) - min(rewards) > 1e-8


FILTERS: dict[str, Callable[[Any, list[Sample]], bool]] = {"nonzero_std": nonzero_std}
