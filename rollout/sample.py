"""The ``Sample`` record one rollout produces, and ``RolloutBatch``, what a step hands the trainer.

Layout invariant (checked by ``Sample.check``): ``tokens`` is prompt + response token ids;
``loss_mask`` and ``rollout_log_probs`` each hold ``response_length`` entries, 1 / the
engine's log-prob for model tokens and 0 / 0.0 for environment tokens. ``append`` is the
one place that grows a response, so the three lists cannot drift apart.

User generate functions written for slime (the seed) assign ``tokens``, ``loss_mask``,
``response_length`` directly and never set ``rollout_log_probs``; ``RolloutBatch`` accepts
that (empty log-prob list, see ``from_samples``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Iterable, Optional, Sequence, Union


@dataclass
class Sample:
    class Status(str, Enum):
        # A str-Enum so it pickles, compares with plain strings and logs readably.
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    # The prompt as text (chat template applied) -- slime-style user code tokenizes it.
    prompt: Union[str, list] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: Optional[list[int]] = None
    rollout_log_probs: Optional[list[float]] = None
    reward: Union[float, dict, None] = None
    label: Any = None
    status: "Sample.Status" = Status.PENDING
    metadata: dict = field(default_factory=dict)
    index: Optional[int] = None
    group_index: Optional[int] = None
    # Policy version of the oldest token (partial rollouts may span versions).
    weight_version: Optional[int] = None

    # ---- derived views -------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    @property
    def scalar_reward(self) -> float:
        """The reward as one float (a dict reward carries it under ``"reward"``)."""
        r = self.reward
        if isinstance(r, dict):
            if "reward" not in r:
                raise ValueError(f"sample {self.index}: a dict reward needs a 'reward' key "
                                 f"(got keys {sorted(r)})")
            r = r["reward"]
        if r is None:
            raise ValueError(f"sample {self.index}: no reward was assigned")
        return float(r)

    # ---- growth ----------------------------------------------------------------------
    def set_prompt(self, prompt_ids: list[int]) -> None:
        """Start (or restart) the sample from prompt tokens with an empty response."""
        self.tokens = list(prompt_ids)
        self.response = ""
        self.response_length = 0
        self.loss_mask = []
        self.rollout_log_probs = []

    def append(self, token_ids: list[int], *, trainable: bool,
               log_probs: Optional[list[float]] = None, text: str = "") -> None:
        """Append one response segment, keeping tokens, loss_mask and log-probs aligned.

        Model tokens (``trainable``) carry the engine's per-token log-probs; environment
        tokens get mask 0 and log-prob 0.0.
        """
        n = len(token_ids)
        if log_probs is None:
            log_probs = [0.0] * n
        elif len(log_probs) != n:
            raise ValueError(f"append: {n} tokens but {len(log_probs)} log-probs")
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * self.response_length
        self.tokens.extend(token_ids)
        self.loss_mask.extend([1 if trainable else 0] * n)
        self.rollout_log_probs.extend(log_probs)
        self.response_length += n
        self.response += text

    def check(self) -> None:
        """Raise ValueError when the token/mask/log-prob layout is inconsistent."""
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise ValueError(f"sample {self.index}: response_length {self.response_length} "
                             f"outside 0..{len(self.tokens)}")
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"sample {self.index}: loss_mask has {len(self.loss_mask)} entries,"
                             f" response_length is {self.response_length}")
        if self.rollout_log_probs and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"sample {self.index}: rollout_log_probs has "
                             f"{len(self.rollout_log_probs)} entries, response_length is "
                             f"{self.response_length}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d


Status = Sample.Status


@dataclass
class RolloutBatch:
    """One training step's samples as plain lists, one entry per sample, groups contiguous.

    ``rollout_log_probs[i]`` has ``response_lengths[i]`` entries, or is empty when the
    generate function did not record log-probs (slime-style custom code that posts text);
    the trainer then has only its own recomputed log-probs for that sample.
    """

    tokens: list[list[int]] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    loss_masks: list[list[int]] = field(default_factory=list)
    rollout_log_probs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    # Each sample's label (the task), kept so a run can log and check its data order.
    labels: list[Any] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> "RolloutBatch":
        """The samples at ``indices``, in that order, with every per-sample field and the
        batch's metrics: the one place a batch is cut, so a new field cannot be left out."""
        per_sample = {f.name: [getattr(self, f.name)[i] for i in indices]
                      for f in fields(self) if f.name != "metrics"}
        return RolloutBatch(**per_sample, metrics=dict(self.metrics))

    @classmethod
    def from_samples(cls, samples: Iterable[Sample],
                     metrics: Optional[dict[str, float]] = None) -> "RolloutBatch":
        batch = cls(metrics=dict(metrics or {}))
        for s in samples:
            s.check()
            reward = s.scalar_reward
            if not math.isfinite(reward):
                raise ValueError(f"sample {s.index}: reward {reward} is not finite")
            mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
            batch.tokens.append(list(s.tokens))
            batch.response_lengths.append(s.response_length)
            batch.loss_masks.append(list(mask))
            batch.rollout_log_probs.append(list(s.rollout_log_probs or []))
            batch.rewards.append(reward)
            batch.group_ids.append(-1 if s.group_index is None else int(s.group_index))
            batch.weight_versions.append(-1 if s.weight_version is None else int(s.weight_version))
            batch.statuses.append(Sample.Status(s.status).value)
            batch.labels.append(s.label)
        return batch
