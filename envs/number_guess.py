"""The seed's guessing game: find a hidden integer in 1..20 within a turn budget.

Each model turn must be ``<answer>N</answer>``; the environment answers with
``<feedback>higher</feedback>`` or ``<feedback>lower</feedback>`` (rendered by the driver as
a chat user turn). Reward, as in the seed (PipelineRL-style shaping): success
``2.0 - 0.1 * (turns - 1)``, malformed turn ``-2.0`` (ends the episode), otherwise ``-1.0``.
Train on odd targets, evaluate on even ones.

Scripted players for the supervised warm-up: ``binary`` search; ``random`` guesses inside
the range still consistent with the feedback; ``careless`` binary search that, after its
first guess, wastes a turn with probability ``repeat_prob`` by repeating its previous
guess. A mix teaches the format plus a sensible strategy while leaving RL something to
improve.

Which mix matters for the held-out split. A random player's last guesses pick among
numbers of both parities, and RL on odd targets rightly learns to prefer odd ones ("the
answer is odd"), which costs even targets. The careless player's only mistake, a repeated
guess, is wrong whatever the target, so what RL learns from it (stop repeating) carries
over to even targets.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Optional

from envs.base import Environment, StepResult, register

MAX_VALUE = 20
MAX_TURNS = 6
PROMPT = (
    "You are playing a number guessing game.\n"
    "The hidden integer is between 1 and 20.\n"
    "Return only guesses in this exact format: <answer>N</answer> "
    "where N is an integer between 1 and 20.\n"
    "After each guess, you will receive <feedback>higher</feedback> or "
    "<feedback>lower</feedback>, and must update your next guess accordingly."
)
TRAIN_TARGETS = list(range(1, MAX_VALUE + 1, 2))
EVAL_TARGETS = list(range(2, MAX_VALUE + 1, 2))

ANSWER_RE = re.compile(r"<answer>\s*(\d+)\s*</answer>", re.IGNORECASE)
PLAYERS = ("binary", "random", "careless")


def extract_answer(text: str) -> Optional[int]:
    """The last ``<answer>N</answer>`` with N in range, else None (as in the seed)."""
    matches = list(ANSWER_RE.finditer(text))
    if not matches:
        return None
    guess = int(matches[-1].group(1))
    return guess if 1 <= guess <= MAX_VALUE else None


def trajectory_reward(success: bool, format_error: bool, turns_taken: int) -> float:
    if success:
        return float(2.0 - 0.1 * max(0, turns_taken - 1))
    if format_error:
        return -2.0
    return -1.0


def parse_target(label: Any) -> int:
    """The hidden number from a label: ``{"answer": N}`` as dict or JSON string, or N."""
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as e:
            raise ValueError(f"number_guess: label {label!r} is not JSON") from e
    if isinstance(label, dict):
        label = label.get("answer")
    if isinstance(label, bool) or not isinstance(label, int) or not 1 <= label <= MAX_VALUE:
        raise ValueError(f"number_guess: label needs an integer answer in 1..{MAX_VALUE} "
                         f"(got {label!r})")
    return label


@register("number_guess")
class NumberGuessEnv(Environment):
    def __init__(self, max_turns: int = MAX_TURNS, seed: Optional[int] = None,
                 players: tuple[str, ...] | list[str] = ("binary", "careless"),
                 repeat_prob: float = 0.5) -> None:
        super().__init__(max_turns=max_turns, seed=seed)
        unknown = set(players) - set(PLAYERS)
        if not players or unknown:
            raise ValueError(f"number_guess: players must be a non-empty subset of {PLAYERS}")
        if not 0.0 <= repeat_prob <= 1.0:
            raise ValueError(f"number_guess: repeat_prob must be in [0, 1] (got {repeat_prob})")
        self.players = tuple(players)
        self.repeat_prob = repeat_prob
        self.target = 0
        self.turns = 0
        self.low, self.high = 1, MAX_VALUE
        self.done = False
        self._rng = random.Random(seed)
        self.player = self.players[0]
        self.last_guess: Optional[int] = None

    async def reset(self, sample: Any) -> str:
        self.target = parse_target(getattr(sample, "label", sample))
        self.turns = 0
        self.low, self.high = 1, MAX_VALUE
        self.done = False
        self.player = self._rng.choice(self.players)
        self.last_guess = None
        return PROMPT

    def _info(self, success: bool, format_error: bool) -> dict:
        return {"success": success, "format_error": format_error,
                "turns_taken": self.turns, "target": self.target}

    async def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("number_guess: step() after the episode ended")
        self.turns += 1
        guess = extract_answer(action_text)
        self.last_guess = guess
        if guess is None:
            self.done = True
            return "", trajectory_reward(False, True, self.turns), True, self._info(False, True)
        if guess == self.target:
            self.done = True
            return "", trajectory_reward(True, False, self.turns), True, self._info(True, False)
        if guess < self.target:
            self.low = max(self.low, guess + 1)
            feedback = "higher"
        else:
            self.high = min(self.high, guess - 1)
            feedback = "lower"
        if self.turns >= self.max_turns:
            self.done = True
            return "", trajectory_reward(False, False, self.turns), True, self._info(False, False)
        return f"<feedback>{feedback}</feedback>", 0.0, False, self._info(False, False)

    def demo_action(self) -> str:
        if self.player == "random":
            guess = self._rng.randint(self.low, self.high)
        elif (self.player == "careless" and self.last_guess is not None
              and self._rng.random() < self.repeat_prob):
            guess = self.last_guess
        else:
            guess = (self.low + self.high) // 2
        return f"<answer>{guess}</answer>"

    @classmethod
    def dataset(cls, split: str, **kwargs: Any) -> list[dict]:
        if split not in ("train", "eval"):
            raise ValueError(f"number_guess: split must be 'train' or 'eval' (got {split!r})")
        targets = TRAIN_TARGETS if split == "train" else EVAL_TARGETS
        return [{"messages": [{"role": "user", "content": PROMPT}],
                 "label": json.dumps({"answer": t})} for t in targets]
