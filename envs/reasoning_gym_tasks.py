"""reasoning-gym's procedural tasks as a single-turn environment.

    python -m trainer.main env=reasoning_gym env.task=chain_sum env.kwargs.max_terms=2

``env.task`` names a reasoning-gym dataset and ``env.kwargs`` holds its config (anything
``reasoning_gym.create_dataset(task, **config)`` takes, except ``seed`` and ``size``, which
the adapter sets per split) plus the adapter's own options below. The train split is
``create_dataset(task, seed=data_seed, size=train_size)``; the eval split comes from seed
``data_seed + EVAL_SEED_OFFSET`` (reasoning-gym draws entry i from ``seed + i``, so a nearby
seed would repeat the train split shifted by a few rows) with every question that the train
split asks left out, so held-out success is measured on questions training never saw.

The model's reply, stripped (or, with ``answer_tag``, the text inside the last
``<answer>...</answer>``), is scored by the dataset's own ``score_answer(answer, entry)``:
a score in [0, 1] that is the reward; ``success`` is a score of 1.

Needs the ``reasoning_gym`` extra (reasoning-gym 0.1.25; its tasks run offline).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from envs.base import (Environment, EnvSetupError, StepResult, register, registered,
                       require)

EXTRA = "reasoning_gym"
# create_dataset arguments the adapter sets itself, one split at a time.
_SPLIT_KEYS = {"seed": "data_seed", "size": "train_size / env.kwargs.eval_size"}
EVAL_SEED_OFFSET = 1_000_000_000  # below 2**32 (numpy's seed limit) with room
# How many eval-seed questions to look at per eval row wanted before giving up on finding
# enough that the train split does not ask.
_EVAL_CANDIDATES_PER_ROW = 10
_DATASETS: dict[tuple, Any] = {}  # (task, seed, size, config) -> dataset, per process


def _rg() -> Any:
    return require("reasoning_gym", package="reasoning-gym", extra=EXTRA)


def _dataset(task: str, seed: int, size: int, config: dict) -> Any:
    """The dataset, built once per process (entries are generated on access from seed +
    index, so an entry is the same wherever it is built)."""
    key = (task, seed, size, json.dumps(config, sort_keys=True, default=repr))
    ds = _DATASETS.get(key)
    if ds is None:
        ds = _DATASETS[key] = _rg().create_dataset(task, seed=seed, size=size, **config)
    return ds


def _system_prompt(text: Optional[str]) -> Optional[str]:
    """A key of reasoning-gym's SYSTEM_PROMPTS ("direct", "default", ...) or the text."""
    if text is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(text, text)


@register("reasoning_gym")
class ReasoningGymTask(Environment):
    """One question of a reasoning-gym dataset, answered in one turn."""

    def __init__(self, max_turns: int = 1, seed: Optional[int] = None, task: Optional[str] = None,
                 train_size: int = 1000, eval_size: int = 200, data_seed: int = 0,
                 system_prompt: Optional[str] = None, answer_tag: Optional[str] = None,
                 **task_config: Any) -> None:
        # One turn whatever env.max_turns says: the task gives no feedback to act on.
        super().__init__(max_turns=1, seed=seed)
        _rg()
        self.task, self.task_config, self.answer_tag = task, task_config, answer_tag
        self.dataset_obj: Any = None
        self.entry: dict = {}

    # ---- start-up ---------------------------------------------------------------------
    @classmethod
    def check_setup(cls, task: Optional[str] = None, train_size: int = 1000,
                    eval_size: int = 200, data_seed: int = 0, system_prompt: Optional[str] = None,
                    answer_tag: Optional[str] = None, **task_config: Any) -> None:
        rg = _rg()
        from reasoning_gym.factory import DATASETS

        registered(task, DATASETS, key="env.task", what="reasoning-gym task",
                   example="env=reasoning_gym env.task=chain_sum")
        for key, ours in _SPLIT_KEYS.items():
            if key in task_config:
                raise EnvSetupError(f"env.kwargs.{key}: set by the adapter per split; use "
                                    f"env.kwargs.{ours}")
        if train_size < 1 or eval_size < 1:
            raise EnvSetupError("env.kwargs.train_size / eval_size: must be >= 1")
        try:
            rg.create_dataset(task, seed=data_seed, size=1, **task_config)
        except (TypeError, ValueError, AssertionError) as err:
            raise EnvSetupError(f"env.kwargs: reasoning-gym task {task!r} rejects "
                                f"{task_config}: {err or type(err).__name__}") from err

    # ---- rows -------------------------------------------------------------------------
    @classmethod
    def dataset(cls, split: str, task: Optional[str] = None, train_size: int = 1000,
                eval_size: int = 200, data_seed: int = 0, system_prompt: Optional[str] = None,
                answer_tag: Optional[str] = None, **task_config: Any) -> list[dict]:
        if split not in ("train", "eval"):
            raise ValueError(f"reasoning_gym: split must be 'train' or 'eval' (got {split!r})")
        if not task:
            raise EnvSetupError("env.task: must name a reasoning-gym task")
        train = _dataset(task, data_seed, train_size, task_config)
        if split == "train":
            picked = [(data_seed, train_size, i) for i in range(train_size)]
        else:
            seen = {train[i]["question"] for i in range(train_size)}
            size = eval_size * _EVAL_CANDIDATES_PER_ROW
            candidates = _dataset(task, data_seed + EVAL_SEED_OFFSET, size, task_config)
            picked, asked = [], set()
            for i in range(size):
                question = candidates[i]["question"]
                if question not in seen and question not in asked:
                    asked.add(question)
                    picked.append((data_seed + EVAL_SEED_OFFSET, size, i))
                    if len(picked) == eval_size:
                        break
            if not picked:
                raise EnvSetupError(
                    f"env.kwargs.train_size: the train split ({train_size} rows) asks every "
                    f"question of task {task!r} that {size} eval draws found: no held-out "
                    "questions left; lower train_size or widen the task's config")
        system = _system_prompt(system_prompt)
        rows = []
        for seed, size, index in picked:
            entry = _dataset(task, seed, size, task_config)[index]
            messages = [{"role": "user", "content": entry["question"]}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            rows.append({"messages": messages,
                         "label": {"seed": seed, "size": size, "index": index,
                                   "answer": str(entry["answer"])}})
        return rows

    # ---- one episode ------------------------------------------------------------------
    async def reset(self, sample: Any) -> str:
        label = getattr(sample, "label", sample)
        if isinstance(label, str):
            label = json.loads(label)
        if not (isinstance(label, dict) and {"seed", "size", "index"} <= set(label)):
            raise ValueError(f"reasoning_gym: label must be a row label of this environment's "
                             f"dataset ({{seed, size, index}}), got {label!r}")
        self.dataset_obj = _dataset(self.task, int(label["seed"]), int(label["size"]),
                                    self.task_config)
        self.entry = self.dataset_obj[int(label["index"])]
        return self.entry["question"]

    def answer_of(self, text: str) -> Optional[str]:
        """What is scored: the reply stripped, or the text in its last answer tag (None
        when there is none)."""
        if self.answer_tag is None:
            return text.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(text, tag_name=self.answer_tag)

    async def step(self, action_text: str) -> StepResult:
        answer = self.answer_of(action_text)
        score = float(self.dataset_obj.score_answer(answer, self.entry))
        info = {"success": score >= 1.0, "score": score, "format_error": answer is None,
                "turns_taken": 1}
        return "", score, True, info

    def demo_action(self) -> str:
        answer = str(self.entry["answer"])
        return answer if self.answer_tag is None else \
            f"<{self.answer_tag}>{answer}</{self.answer_tag}>"
