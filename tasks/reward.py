"""reward: score every completion of the batch with the reward pool (retried)."""

from __future__ import annotations

import math
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core import faults
from rl_core.rewards import reward_inputs


@task(name="reward", cache_policy=NO_CACHE)
def reward_task(rewards: Any, examples: list, texts: list[str]) -> tuple[list[float], dict[str, float]]:
    """`(reward per completion, rollout/rewards/<name>/mean)`; `examples[i]` is completion i's prompt."""
    faults.maybe_fail("reward")  # the fault-injection test hook (inert unless armed)
    values, means = rewards.score(reward_inputs(examples, texts))
    if faults.should_fail("reward_nan"):
        values[0] = math.nan
    return values, means
