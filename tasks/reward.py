"""reward: score every completion of the batch with the reward pool (retried)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.rewards import Scores, reward_inputs


@task(name="reward", task_run_name="reward step {step}", cache_policy=NO_CACHE)
def reward_task(rewards: Any, examples: list, texts: list[str], episodes: list[dict] | None = None, *,
                step: int) -> Scores:
    """The batch's `Scores`: the reward per completion, `rollout/rewards/<name>/mean` and each function's own values;
    `examples[i]` is completion i's prompt, `episodes[i]` its episode's record for an agent task (the rewards then
    read the whole conversation)."""
    return rewards.scores(reward_inputs(examples, texts, episodes))
