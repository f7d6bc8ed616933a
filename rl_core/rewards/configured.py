"""The reward functions a config scores with: `data.rewards` (imported and checked, with their weights; a reward
model's entry as a `ModelReward`), or the task's own rewards (weight 1) when it is empty; an environment's own
reward comes first in both cases."""

from __future__ import annotations

from typing import Any

from rl_core.rewards import RewardFunction
from rl_core.tasks import get_task
from rl_core.user_code import REWARD_PARAMS, load_callable

REWARD_MODEL_NAME, JUDGE_NAME = "reward_model", "judge"  # the names of a reward model's and a judge's entries


def entry_name(entry: Any) -> str:
    """A `data.rewards` entry's name: its `name`, else its function's (the last part of its import path), or
    `reward_model` for a reward model."""
    if entry.name:
        return entry.name
    if entry.path is None:
        return REWARD_MODEL_NAME if entry.judge is None else JUDGE_NAME
    return entry.path.rpartition(":")[2].rpartition(".")[2]


def reward_names(data: Any, task: Any = None) -> list[str]:
    """The names of `reward_functions(data)`, in order, without importing `data.rewards`."""
    if task is None:
        task = get_task(data.task)
    own = [entry_name(e) for e in data.rewards] if data.rewards else [name for name, _ in task.default_rewards(data)]
    return [name for name, _ in task.fixed_rewards(data)] + own


def reward_functions(data: Any, task: Any = None) -> list[RewardFunction]:
    """The task's fixed rewards (an environment's), then `data.rewards` (imported and checked), or the task's own
    rewards when it is empty."""
    if task is None:
        task = get_task(data.task)
    out = [RewardFunction(name, fn, 1.0, f"data.task={data.task}") for name, fn in task.fixed_rewards(data)]
    if not data.rewards:
        return out + [RewardFunction(name, fn, 1.0, f"data.task={data.task}") for name, fn in task.default_rewards(data)]
    for i, entry in enumerate(data.rewards):
        key = f"data.rewards[{i}]"
        name = entry_name(entry)
        if entry.model is not None:  # scored by the cluster's reward-model role; in this process, loaded when called
            from rl_core.rewards.model import ModelReward

            out.append(RewardFunction(name, ModelReward(entry, data, f"{key}.model"), float(entry.weight), key,
                                      model=entry))
            continue
        if entry.judge is not None:  # a local one: the reward-model role's; an endpoint: called from this process
            from rl_core.rewards.judge import JudgeReward

            out.append(RewardFunction(name, JudgeReward(entry, key), float(entry.weight), key, model=entry))
            continue
        fn = load_callable(entry.path, f"{key}.path", REWARD_PARAMS, by_keyword=True)
        out.append(RewardFunction(name, fn, float(entry.weight), key))
    return out
