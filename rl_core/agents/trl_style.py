"""Environments written for TRL's `GRPOTrainer(environment_factory=...)`, run unchanged as posttrain environments.

TRL's convention: the class is built with no arguments, once per episode; `reset(**row)` receives the dataset row
and returns None or a string that is appended to the last user message of the prompt; every other public method
(not starting with `_`) is a tool, with type hints and a docstring as any tool; `get_reward()`, when the class
defines it, scores the ended episode from the environment's state. `data.task=pkg.mod:MyEnv` naming such a class
(one that is neither a `Task` nor an `Environment`, and has a `reset`) runs it through `trl_environment`.

A tool is a plain function the class (or a base other than `object`) defines under a public name, bound to the
episode's instance and named by that attribute (`tool_functions`). What the instance holds is never a tool: an
attribute set in `__init__` to another object's method (`self.fetch = client.delete`) would hand the model that
object's methods under their own names. Nor is a classmethod or staticmethod: they act beyond the episode's
instance.

What differs from TRL: the reward functions of `data.rewards` read the conversation, never the environment
objects (TRL passes them as `environments=`), since they run in other processes; an environment without
`get_reward` gets a constant 0 as its `environment` reward, so `data.rewards` carries the signal; tools and
`get_reward` are synchronous methods.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from rl_core.agents.environment import Environment

SPECIAL = ("reset", "get_reward")


def is_trl_style(obj: Any) -> bool:
    """Whether `obj` is a class in TRL's environment convention: a callable `reset`, not an `Environment` (the
    caller has ruled out a `Task`)."""
    return isinstance(obj, type) and not issubclass(obj, Environment) and callable(getattr(obj, "reset", None))


def tool_functions(instance: Any) -> tuple[Callable, ...]:
    """The tools of `instance` (module docstring): its class's public functions but `reset` and `get_reward`, each
    bound to `instance` and named by its attribute, sorted by name."""
    functions: dict[str, Callable] = {}
    seen: set[str] = set()
    for cls in type(instance).__mro__[:-1]:  # the class first: what it defines under a name wins; `object` left out
        for name, value in vars(cls).items():
            if name not in seen and inspect.isfunction(value) and not name.startswith("_") and name not in SPECIAL:
                functions[name] = value
            seen.add(name)
    return tuple(_named(name, types.MethodType(functions[name], instance)) for name in sorted(functions))


def _named(name: str, method: Callable) -> Callable:
    """`method` under the name `name`: its schema (`tool_schema`) and its calls go by the attribute, not by the
    function's own `__name__`; signature, type hints and docstring are the method's."""

    @functools.wraps(method)
    def tool(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    tool.__name__ = tool.__qualname__ = name
    return tool


def trl_environment(factory: type) -> type[Environment]:
    """The posttrain `Environment` that runs one `factory()` instance per episode (module docstring)."""

    class TRLStyle(Environment):
        def __init__(self, example: Any):
            super().__init__(example)
            self.inner = factory()
            self.tools = tool_functions(self.inner)

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
