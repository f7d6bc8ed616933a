"""reward: score every completion against its prompt's answer (retried)."""

from __future__ import annotations

from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="reward", cache_policy=NO_CACHE)
def reward_task(reward_fn: Callable[[str, str], float], texts: list[str], answers: list[str]) -> list[float]:
    return [float(reward_fn(text, answer)) for text, answer in zip(texts, answers, strict=True)]
