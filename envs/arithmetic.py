"""Arithmetic word problems generated from a seed: a single-turn task with a checkable answer.

Needs no download. Problems are small sums, differences and products phrased as short word
problems; the model answers ``<answer>N</answer>``. Reward 1.0 for the right number, 0.0 for
a wrong one, -1.0 for a malformed answer. Train and eval draw from different seeds.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Optional

from envs.base import Environment, StepResult, register

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.IGNORECASE)
INSTRUCTION = "Solve the problem. Reply only with <answer>N</answer> where N is an integer."
_TEMPLATES = {
    "+": "{name} has {a} apples and buys {b} more. How many apples does {name} have?",
    "-": "{name} has {a} apples and gives away {b}. How many apples does {name} have left?",
    "*": "{name} fills {a} boxes with {b} apples each. How many apples is that?",
}
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana")
_SPLIT_SEEDS = {"train": 0, "eval": 1}


def make_problem(rng: random.Random, max_operand: int) -> tuple[str, int]:
    op = rng.choice(sorted(_TEMPLATES))
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative: simpler for small models
    if op == "*":
        a, b = a % 10, b % 10
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return _TEMPLATES[op].format(name=rng.choice(_NAMES), a=a, b=b), answer


def extract_answer(text: str) -> Optional[int]:
    matches = list(ANSWER_RE.finditer(text))
    return int(matches[-1].group(1)) if matches else None


@register("arithmetic")
class ArithmeticEnv(Environment):
    def __init__(self, max_turns: int = 1, seed: Optional[int] = None, **_: Any) -> None:
        # Single turn whatever env.max_turns says: there is no feedback to act on.
        super().__init__(max_turns=1, seed=seed)
        self.answer = 0

    async def reset(self, sample: Any) -> str:
        label = getattr(sample, "label", sample)
        if isinstance(label, str):
            label = json.loads(label)
        if isinstance(label, dict):
            label = label.get("answer")
        if isinstance(label, bool) or not isinstance(label, int):
            raise ValueError(f"arithmetic: label needs an integer answer (got {label!r})")
        self.answer = label
        return ""

    async def step(self, action_text: str) -> StepResult:
        guess = extract_answer(action_text)
        info = {"success": guess == self.answer, "format_error": guess is None,
                "turns_taken": 1}
        reward = -1.0 if guess is None else (1.0 if guess == self.answer else 0.0)
        return "", reward, True, info

    def demo_action(self) -> str:
        return f"<answer>{self.answer}</answer>"

    @classmethod
    def dataset(cls, split: str, size: Optional[int] = None, max_operand: int = 20,
                **_: Any) -> list[dict]:
        if split not in _SPLIT_SEEDS:
            raise ValueError(f"arithmetic: split must be 'train' or 'eval' (got {split!r})")
        rng = random.Random(_SPLIT_SEEDS[split])
        n = size if size is not None else (1000 if split == "train" else 100)
        rows = []
        for _ in range(n):
            question, answer = make_problem(rng, max_operand)
            rows.append({"messages": [{"role": "user", "content": f"{INSTRUCTION}\n{question}"}],
                         "label": json.dumps({"answer": answer})})
        return rows
