"""evaluate: greedy held-out completions with the rollout engine's current weights, scored by the reward pool."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.evaluation.heldout import evaluate_accuracy


@task(name="evaluate", task_run_name="evaluate step {step}", cache_policy=NO_CACHE)
def evaluate_task(engine: Any, tokenizer: Any, examples: list, data_cfg: Any, max_tokens: int,
                  rewards: Any = None, *, step: int, max_turns: int = 1,
                  max_episode_tokens: int | None = None, scheduling: str = "per_episode",
                  environments: Any = None) -> dict[str, float]:
    """`max_turns` / `max_episode_tokens` / `scheduling`: an agent task's episode limits and scheduling
    (`rollout.*`); `environments`: where its environments live (`infra.workers.environments.EnvironmentPool`)."""
    result = evaluate_accuracy(None, tokenizer, examples, data=data_cfg, max_tokens=max_tokens, engine=engine,
                               scorer=rewards.scores if rewards is not None else None, max_turns=max_turns,
                               max_episode_tokens=max_episode_tokens, scheduling=scheduling,
                               environments=environments)
    return {"val/accuracy": result["accuracy"], "val/mean_reward": result["mean_reward"], "val/n": result["n"]}
