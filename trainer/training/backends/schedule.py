"""Learning-rate schedule as a pure function of the optimizer step (checkpoint = one int)."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, schedule: str, warmup_steps: int,
          total_steps: int) -> float:
    """LR for optimizer step ``step`` (0-based).

    Linear warm-up from lr/warmup_steps to lr over ``warmup_steps``, then constant, or a
    cosine/linear decay to ``min_lr`` at ``total_steps``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    raise ValueError(f"train.lr_schedule: must be constant, cosine or linear (got {schedule!r})")

