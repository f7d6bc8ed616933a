"""Reward functions: plain Python `reward(completion_text, answer) -> float`, selected by config.

`get_reward_fn(task, reward_mode)` returns the function for `data.task` ('arithmetic' | 'gsm8k')
and `data.reward_mode` ('strict' | 'flexible'; only GSM8K reads it); `data.custom_reward` names
your own function by import path instead (docs/objectives.md).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

from rl_core import faults
from rl_core.rewards.arithmetic import arithmetic_reward
from rl_core.rewards.gsm8k import gsm8k_reward

RewardFn = Callable[[str, str], float]
TASKS = ("arithmetic", "gsm8k")


def get_reward_fn(task: str, reward_mode: str = "strict") -> RewardFn:
    """The reward function of `task`; for GSM8K bound to `reward_mode`."""
    if task == "arithmetic":
        return arithmetic_reward
    if task == "gsm8k":
        if reward_mode not in ("strict", "flexible"):
            raise ValueError(f"data.reward_mode={reward_mode!r} is not one of 'strict', 'flexible'")
        return functools.partial(gsm8k_reward, mode=reward_mode)
    raise ValueError(f"data.task={task!r} has no reward; known tasks: {', '.join(TASKS)}")


def configured_reward(data_cfg) -> RewardFn:
    """`data.custom_reward` (a `module:function` path) when set, else `get_reward_fn(data.task, data.reward_mode)`."""
    if data_cfg.custom_reward:
        from rl_core.registry import REWARD_PARAMS, load_callable

        return load_callable(data_cfg.custom_reward, "data.custom_reward", REWARD_PARAMS)
    return get_reward_fn(data_cfg.task, data_cfg.reward_mode)


def reward_fn_from_config(data_cfg) -> RewardFn:
    """The training reward: `configured_reward(data_cfg)`, with the fault-injection test hook when it is armed."""
    fn = configured_reward(data_cfg)
    if not os.environ.get(faults.ENV):
        return fn

    def reward_with_faults(completion: str, answer: str) -> float:
        faults.maybe_fail("reward")
        return math.nan if faults.should_fail("reward_nan") else fn(completion, answer)

    return reward_with_faults


__all__ = ["RewardFn", "arithmetic_reward", "configured_reward", "get_reward_fn", "gsm8k_reward",
           "reward_fn_from_config"]
