"""reward: score every completion of the batch with the reward pool (retried)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.rewards import reward_inputs


@task(name="reward", task_run_name="reward step {step}", cache_policy=NO_CACHE)
def reward_task(rewards: Any, examples: list, texts: list[str], episodes: list[dict] | None = None, *,
                step: int) -> tuple[list[float], dict[str, float]]:
    """`(reward per completion, rollout/rewards/<name>/mean)`; `examples[i]` is completion i's prompt, `episodes[i]`
    its episode's record for an agent task (the rewards then read the whole conversation)."""
    values, means = rewards.score(reward_inputs(examples, texts, episodes))
    return values, means
