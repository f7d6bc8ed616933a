"""Where a step's environments live, and the three calls a rollout makes on them, each over a batch of episodes.

Episode `k` (a key the rollout chooses, unique among the episodes in flight) has one environment, built from its
dataset row by `open` and dropped by `finish`. `LocalEnvironments` keeps them in this process; `infra.workers.environments.EnvironmentPool`
keeps them in Ray actors, one share per actor, and bounds every call by `data.env_timeout_s`. Both answer with
the same records, so the rollout (`rl_core.agents.rollout`) does not know where its environments run:

    open(environment, [(k, example)])  -> [Opening]   the opening messages and the tools' JSON schemas
    respond([(k, turn)])               -> [Answer]    the environment's reply to the policy's turn
    finish([k])                        -> [Answer]    the episode's reward; the environment is closed and dropped
    discard([k])                                      drop environments without a reward (a rollout that failed)

A call that raised carries `error` (the exception, named); an answer to a call that did not return in time, or
whose environment was lost with its actor, carries `lost` too (an opening that failed either way: just `error`). Every answer carries the environment's tool counts so
far and the seconds the call took inside the environment.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.agents.environment import Environment, Reply, Turn
from rl_core.user_code import is_bug, raised_at, user_error


@dataclass
class Opening:
    """An episode's start: its opening `messages` and its tools' JSON schemas (None: no tools), or `error`."""

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    seconds: float = 0.0
    error: str | None = None
    max_tokens: int | None = None  # the first turn's cap (`Environment.first_turn_max_tokens`)
    retryable: bool = True  # False: the error is a bug in the environment's code, which a retry meets again


@dataclass
class Answer:
    """The environment's answer to one call: `reply` (respond) or `reward` (finish), or `error`."""

    reply: Reply | None = None
    reward: float | None = None
    seconds: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    refused: int = 0  # an agent function's requests the gateway refused (rl_core.agents.gateway.agent)
    error: str | None = None
    retryable: bool = True  # False: `error` is a bug in the environment's code (`is_bug`), which a retry meets again
    lost: bool = False


def _failure(what: str, exc: BaseException) -> str:
    """The environment's error, credentials removed, with where in its code it was raised."""
    return f"{what} raised {user_error(exc)}{raised_at(exc)}"


class LocalEnvironments:
    """The episodes' environments in this process: no timeout (a hanging tool hangs the rollout), no isolation.
    `infra.workers.environments.EnvironmentPool` runs one of these in each of its actors."""

    def __init__(self) -> None:
        self.live: dict[Hashable, Environment] = {}

    def open(self, environment: type, items: Sequence[tuple[Hashable, Any]]) -> list[Opening]:
        out = []
        for key, example in items:
            began = time.perf_counter()
            try:
                env = environment(example)
            except Exception as exc:  # noqa: BLE001 - named to the caller, which says which row
                out.append(Opening(error=_failure(environment.__name__, exc), seconds=time.perf_counter() - began,
                                   retryable=not is_bug(exc)))
                continue
            opening = self.adopt(key, env)
            opening.seconds = time.perf_counter() - began  # construction and reset
            out.append(opening)
        return out

    def adopt(self, key: Hashable, env: Environment) -> Opening:
        """Keep `env` (already built) as episode `key`'s environment, reset."""
        began = time.perf_counter()
        try:
            messages = [dict(m) for m in env.reset()]
        except Exception as exc:  # noqa: BLE001 - named to the caller, which says which row
            return Opening(error=_failure(f"{type(env).__name__}.reset", exc), seconds=time.perf_counter() - began,
                           retryable=not is_bug(exc))
        try:
            tools = env.tool_schemas()
        except Exception as exc:  # noqa: BLE001 - a tool without a schema: named, with where it is defined
            return Opening(error=f"{type(env).__name__}'s tools: {user_error(exc)}", seconds=time.perf_counter() - began,
                           retryable=False)
        self.live[key] = env
        return Opening(messages, tools, time.perf_counter() - began, max_tokens=env.first_turn_max_tokens)

    def respond(self, items: Sequence[tuple[Hashable, Turn]]) -> list[Answer]:
        out = []
        for key, turn in items:
            env = self.live[key]
            began = time.perf_counter()
            try:
                reply = env.respond(turn)
                if not isinstance(reply, Reply):
                    raise TypeError(f"respond returned a {type(reply).__name__}, not a Reply")
                answer = Answer(reply=reply)
            except Exception as exc:  # noqa: BLE001 - the environment's bug ends this episode, counted
                answer = Answer(error=_failure(f"{type(env).__name__}.respond", exc))
            out.append(self._counted(env, answer, began))
        return out

    def finish(self, keys: Sequence[Hashable]) -> list[Answer]:
        out = []
        for key in keys:
            env = self.live.pop(key)
            began = time.perf_counter()
            try:
                answer = Answer(reward=float(env.reward()))
            except Exception as exc:  # noqa: BLE001 - named to the caller, which says which row
                answer = Answer(error=_failure(f"{type(env).__name__}.reward()", exc), retryable=not is_bug(exc))
            out.append(self._counted(env, answer, began))
            _close(env)
        return out

    @staticmethod
    def _counted(env: Environment, answer: Answer, began: float) -> Answer:
        answer.seconds = time.perf_counter() - began
        results = getattr(env, "tool_results", ())
        answer.tool_calls, answer.tool_errors = len(results), sum(bool(r.error) for r in results)
        answer.refused = int(getattr(env, "refused_requests", 0))
        return answer

    def discard(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            _close(self.live.pop(key, None))


def _close(env: Environment | None) -> None:
    """`env.close()` where it has one (a sandbox, an agent function's thread and session to release); what it raises
    never hides the episode's reward or why it was discarded."""
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001, S110 - see the docstring
            pass
