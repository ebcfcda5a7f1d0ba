"""textarena's single-player games as multi-turn environments.

    python -m trainer.main env=textarena env.id=GuessTheNumber-v0

``env.id`` is a textarena game id (``ta.make(id, **game_kwargs)``); ``env.kwargs`` holds the
game's keyword arguments plus ``train_size`` / ``eval_size`` (games per split). A row is a
game seed: the game's first observation is the prompt, so every sample of a group plays the
same game. Each model turn is the player's action (through the game's action wrappers,
e.g. the brackets GuessTheNumber wants); what the game says back since the last turn (its
messages, board, invalid-move notices; not the echo of the player's own action) is the
observation. textarena's observation wrappers, which repeat the whole history each turn,
are not used: the conversation already holds it. The reward is the game's reward for the
player when the game ends (``close()``); ``success`` is a reward of at least 1.

Seeding: textarena games draw from the global ``random`` (and some from numpy's), and
``reset(seed=)`` reseeds it. Each episode owns its generator states instead: every call
into its game runs with them swapped in and swapped back out afterwards, under a lock, on
the event loop's thread without yielding, so concurrent episodes never draw from each
other's sequences and the rest of the process never sees a reseeded ``random``.

Offline: games that need no download run (GuessTheNumber, Mastermind, Sudoku, 2048,
TowerOfHanoi, Minesweeper, ...); word games call ``nltk.download`` on import and fail here
(``LookupError: Resource 'words' not found``), and multi-player games need opponents this
adapter does not provide. Needs the ``textarena`` extra (textarena 0.7.4).
"""

from __future__ import annotations

import json
import random
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np

from envs.base import (Environment, EnvSetupError, StepResult, register, registered,
                       require, seed_rows)

EXTRA = "textarena"
_RANDOM_LOCK = threading.Lock()


def _ta() -> Any:
    return require("textarena", package="textarena", extra=EXTRA)


class _OwnRandom:
    """An episode's own states of the global ``random`` and ``numpy.random`` generators."""

    def __init__(self, seed: int) -> None:
        self.py = random.Random(seed).getstate()
        self.np = np.random.RandomState(seed % 2**32).get_state()

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        with _RANDOM_LOCK:
            outer_py, outer_np = random.getstate(), np.random.get_state()
            random.setstate(self.py)
            np.random.set_state(self.np)
            try:
                yield
            finally:
                self.py, self.np = random.getstate(), np.random.get_state()
                random.setstate(outer_py)
                np.random.set_state(outer_np)


def _innermost(game: Any) -> Any:
    ta = _ta()
    while isinstance(game, ta.Wrapper):
        game = game.env
    return game


@register("textarena")
class TextArenaGame(Environment):
    """One single-player textarena game per episode."""

    def __init__(self, max_turns: int = 1, seed: Optional[int] = None, id: Optional[str] = None,
                 train_size: int = 1000, eval_size: int = 100, **game_kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, seed=seed)
        _ta()
        self.game_id, self.game_kwargs = id, game_kwargs
        self.game: Any = None
        self.rng: Optional[_OwnRandom] = None
        self.result: Optional[tuple[dict, dict]] = None

    @classmethod
    def check_setup(cls, id: Optional[str] = None, train_size: int = 1000, eval_size: int = 100,
                    **game_kwargs: Any) -> None:
        ta = _ta()
        from textarena.envs.registration import ENV_REGISTRY

        registered(id, ENV_REGISTRY, key="env.id", what="textarena game",
                   example="env=textarena env.id=GuessTheNumber-v0")
        seed_rows("train", train_size, eval_size)  # the sizes are valid
        rng = _OwnRandom(0)
        try:
            with rng.swapped_in():
                game = ta.make(id, **game_kwargs)
                game.reset(num_players=1, seed=0)
        except TypeError as err:
            raise EnvSetupError(f"env.kwargs: textarena game {id!r} rejects {game_kwargs}: "
                                f"{err}") from err
        except Exception as err:
            first = " ".join(str(err).split())[:200]
            raise EnvSetupError(f"env.id: textarena game {id!r} cannot start a single-player "
                                f"game here: {type(err).__name__}: {first}") from err

    @classmethod
    def dataset(cls, split: str, id: Optional[str] = None, train_size: int = 1000,
                eval_size: int = 100, **game_kwargs: Any) -> list[dict]:
        return seed_rows(split, train_size, eval_size)

    # ---- one episode ------------------------------------------------------------------
    def _observation(self) -> str:
        """What the game said to the player since its last action, one message a line."""
        ta = _ta()
        with self.rng.swapped_in():
            player, messages = _innermost(self.game).get_observation()
        lines = [text for sender, text, kind in messages
                 if not (kind == ta.ObservationType.PLAYER_ACTION and sender == player)]
        return "\n".join(line.strip("\n") for line in lines)

    async def reset(self, sample: Any) -> str:
        label = getattr(sample, "label", sample)
        if isinstance(label, str):
            label = json.loads(label)
        if not (isinstance(label, dict) and "seed" in label):
            raise ValueError(f"textarena: label must hold the game's seed ({{seed}}), got "
                             f"{label!r}")
        seed = int(label["seed"])
        self.rng = _OwnRandom(seed)
        with self.rng.swapped_in():
            self.game = _ta().make(self.game_id, **self.game_kwargs)
            self.game.reset(num_players=1, seed=seed)
        return self._observation()

    async def step(self, action_text: str) -> StepResult:
        with self.rng.swapped_in():
            done, _ = self.game.step(action_text)
        player = _innermost(self.game).state.game_info.get(0, {})
        info = {"success": False, "turns_taken": int(player.get("turn_count", 0))}
        if not done:
            return self._observation(), 0.0, False, info
        rewards, _ = self._close_game()
        reward = float((rewards or {}).get(0, 0.0))
        info.update(success=reward >= 1.0, format_error=bool(player.get("invalid_move")))
        return "", reward, True, info

    def _close_game(self) -> tuple[dict, dict]:
        if self.result is None and self.game is not None:
            with self.rng.swapped_in():
                self.result = self.game.close()
        return self.result or ({}, {})

    async def close(self) -> None:
        self._close_game()
