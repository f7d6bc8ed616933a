"""Faults the tests inject from their own code, to exercise retries, the gate and the weight sync's check for real.

Driver-side faults replace a method or a task in the test's own process (the flows run in it): `fail_first` makes
the first calls of a function raise `InjectedFault`, `faulty_reward_task` is the reward task with failed calls or a
NaN reward. An engine's faulty load is installed inside its Ray actor with `__ray_call__`
(`load_one_weight_wrong`). `one_weight_wrong` is the wrong load itself, on a state dict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


def fail_first(function: Callable, calls: int, site: str) -> Callable:
    """`function`, whose first `calls` calls raise InjectedFault naming `site` (then it runs as before)."""
    seen = [0]

    @functools.wraps(function)
    def failing(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] <= calls:
            raise InjectedFault(f"injected fault at {site!r} (call {seen[0]})")
        return function(*args, **kwargs)

    return failing


def faulty_reward_task(fail: int = 0, nan: int = 0):
    """The reward task (`tasks.reward.reward_task`, same name) whose first `fail` calls raise InjectedFault and whose
    next `nan` calls return a NaN reward for completion 0."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from tasks.reward import reward_task

    seen = {"calls": 0, "nan": 0}

    @task(name="reward", task_run_name="reward step {step}", cache_policy=NO_CACHE)
    def reward(rewards: Any, examples: list, texts: list[str], *, step: int) -> tuple[list[float], dict[str, float]]:
        seen["calls"] += 1
        if seen["calls"] <= fail:
            raise InjectedFault(f"injected fault at 'reward' (call {seen['calls']})")
        values, means = reward_task.fn(rewards, examples, texts, step=step)
        seen["nan"] += 1
        if seen["nan"] <= nan:
            values[0] = math.nan
        return values, means

    return reward


def _off_by_one(value: torch.Tensor) -> torch.Tensor:
    bad = value.detach().clone()
    bad.view(-1)[0] += 1
    return bad


def one_weight_wrong(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with its last tensor by name changed by +1 in its first element (a copy of that tensor: the caller's
    is untouched)."""
    name = max(state)
    return {**state, name: _off_by_one(state[name])}


def _corrupted(pairs: Iterable[tuple[str, Any]], target: str) -> Iterator[tuple[str, Any]]:
    for name, value in pairs:
        yield name, (_off_by_one(value) if name == target else value)


def load_one_weight_wrong(worker: Any) -> str:
    """Run inside a separate engine's actor (`actor.__ray_call__.remote(load_one_weight_wrong)`): its next weight
    load ends with one tensor wrong although the bytes arrived intact — the tensor with the largest name, +1 in its
    first element. Returns that tensor's name. The load after it is right again."""
    engine = worker.engine
    hf_model = getattr(engine, "model", None)
    if hf_model is not None:  # HF: the stream is received straight into the engine's parameters
        from infra import distributed

        receive_into = distributed.receive_into

        def receive_then_corrupt(stream: Any, targets: dict[str, torch.Tensor]) -> None:
            distributed.receive_into = receive_into
            receive_into(stream, targets)
            name = max(targets)
            with torch.no_grad():
                targets[name].copy_(_off_by_one(targets[name]))

        distributed.receive_into = receive_then_corrupt
        return max(hf_model.state_dict())
    target = max(spec.name for spec in worker.layout)  # vLLM: the stream it loads from

    def update_then_restore(weights: Any, version: int) -> Any:
        del engine.update_weights  # the class's method again
        return engine.update_weights(_corrupted(weights, target), version)

    engine.update_weights = update_then_restore
    return target
