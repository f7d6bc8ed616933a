"""Environments written for TRL's `GRPOTrainer(environment_factory=...)`, run unchanged as posttrain environments.

TRL's convention: the class is built with no arguments, once per episode; `reset(**row)` receives the dataset row
and returns None or a string that is appended to the last user message of the prompt; every other public method
(not starting with `_`) is a tool, with type hints and a docstring as any tool; `get_reward()`, when the class
defines it, scores the ended episode from the environment's state. `data.task=pkg.mod:MyEnv` naming such a class
(one that is neither a `Task` nor an `Environment`, and has a `reset`) runs it through `trl_environment`.

What differs from TRL: the reward functions of `data.rewards` read the conversation, never the environment
objects (TRL passes them as `environments=`), since they run in other processes; an environment without
`get_reward` gets a constant 0 as its `environment` reward, so `data.rewards` carries the signal; tools and
`get_reward` are synchronous methods.
"""

from __future__ import annotations

import inspect
from typing import Any

from rl_core.agents.environment import Environment

SPECIAL = ("reset", "get_reward")


def is_trl_style(obj: Any) -> bool:
    """Whether `obj` is a class in TRL's environment convention: a callable `reset`, not an `Environment` (the
    caller has ruled out a `Task`)."""
    return isinstance(obj, type) and not issubclass(obj, Environment) and callable(getattr(obj, "reset", None))


def trl_environment(factory: type) -> type[Environment]:
    """The posttrain `Environment` that runs one `factory()` instance per episode (module docstring)."""

    class TRLStyle(Environment):
        def __init__(self, example: Any):
            super().__init__(example)
            self.inner = factory()
            self.tools = tuple(method for name, method in inspect.getmembers(self.inner, inspect.ismethod)
                               if not name.startswith("_") and name not in SPECIAL)

        def reset(self) -> list[dict]:
            messages = super().reset()
            row = {"prompt": [dict(m) for m in self.example.messages] if self.example.messages else self.example.prompt,
                   "answer": self.example.answer, **dict(self.example.columns)}
            observation = self.inner.reset(**row)
            if observation is not None:
                if not isinstance(observation, str):
                    raise TypeError(f"{factory.__name__}.reset returned a {type(observation).__name__}; TRL's "
                                    "convention is None or a string (appended to the last user message)")
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            return messages

        def reward(self) -> float:
            get_reward = getattr(self.inner, "get_reward", None)
            return float(get_reward()) if callable(get_reward) else 0.0

    TRLStyle.__name__ = factory.__name__  # for messages: `MyEnv.respond raised ...`
    TRLStyle.__doc__ = f"{factory.__name__} (TRL's environment_factory convention), as a posttrain environment."
    return TRLStyle
