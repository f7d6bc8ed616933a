"""evaluate: greedy exact match on held-out prompts with the rollout engine's current weights."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.evaluation import evaluate_accuracy
from rl_core.rewards import configured_reward


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(engine: Any, tokenizer: Any, examples: list, data_cfg: Any, max_tokens: int) -> dict[str, float]:
    result = evaluate_accuracy(
        None, tokenizer, examples, task=data_cfg.task, reward_mode=data_cfg.reward_mode,
        prompt_template=data_cfg.prompt_template, max_tokens=max_tokens, engine=engine,
        reward_fn=configured_reward(data_cfg),
    )
    return {"val/accuracy": result["accuracy"], "val/mean_reward": result["mean_reward"], "val/n": result["n"]}
