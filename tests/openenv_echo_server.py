"""A small text environment written with openenv-core, served with uvicorn (tests only).

    python tests/openenv_echo_server.py PORT

Each session asks for a secret word chosen by the reset seed ("Say the word: apple"), at
most ``MAX_TURNS`` times. The reward of a reply is its similarity to the word (difflib
ratio, so any text earns something and groups differ); saying it exactly ends the episode
with ``success``. The observation's ``turn`` counts this session's steps: sessions that
shared state would see each other's words and counts.
"""

from __future__ import annotations

import difflib
import random
import sys
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

WORDS = ["apple", "river", "candle", "forest", "harbor", "marble", "pepper", "silver",
         "tunnel", "violet", "walnut", "yellow"]
MAX_TURNS = 3


def word_for(seed: int) -> str:
    return random.Random(seed).choice(WORDS)


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    text: str = ""
    turn: int = 0
    success: bool = False


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.word = ""
        self._state = State(step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> EchoObservation:
        self.word = word_for(0 if seed is None else seed)
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(text=f"Say the word: {self.word}")

    def step(self, action: EchoAction, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        said = action.message.strip()
        success = said == self.word
        done = success or self._state.step_count >= MAX_TURNS
        reward = difflib.SequenceMatcher(None, said, self.word).ratio()
        text = "Correct." if success else f"No. Say the word: {self.word}"
        return EchoObservation(text=text, turn=self._state.step_count, success=success,
                               reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo",
                 max_concurrent_envs=256)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
