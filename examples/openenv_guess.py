"""An OpenEnv environment written in OpenEnv's own API, and the posttrain task that trains on it
(docs/agents.md, "An OpenEnv environment").

`GuessEnvironment` is the server side as OpenEnv writes it (an `Environment` with `reset`, `step` and `state`, typed
`Action` and `Observation`); `app` serves it (`uvicorn examples.openenv_guess:app`). `GuessTask` is what
`data.task=examples.openenv_guess:GuessTask` names: each row's episode is a session of that server, started on
127.0.0.1 by the process that hosts the episode, the model guessing through the `guess` tool.
"""

from __future__ import annotations

import random

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

from rl_core.agents.openenv import openenv_environment

HIGH = 8  # secrets 1..HIGH
TRIES = 4


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(description=f"a whole number from 1 to {HIGH}")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="what the game says")


class GuessState(State):
    secret: int = 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, secret=random.Random(seed).randint(1, HIGH))
        return GuessObservation(feedback=f"I picked a number from 1 to {HIGH}; you have {TRIES} guesses.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **_) -> GuessObservation:
        self._state.step_count += 1
        if action.number == self._state.secret:
            return GuessObservation(feedback="correct", done=True, reward=1.0)
        hint = "higher" if action.number < self._state.secret else "lower"
        return GuessObservation(feedback=hint, done=self._state.step_count >= TRIES, reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

GuessTask = openenv_environment("examples.openenv_guess:app", GuessAction, tool="guess", reset_columns=("seed",))
