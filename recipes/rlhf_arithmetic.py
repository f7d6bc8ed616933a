"""RLHF on CPU: GRPO whose only reward is the reward model that recipes/rm_arithmetic.py trained (docs/rewards.md).

The policy starts from the warm-started tiny model (as the quickstart) and is rewarded by the reward model's raw
score of each completion (`data.rewards[0]`, `model: runs/rm-arithmetic`: the finished run's `final_model/`); its
replicas sit beside the trainer ranks. The rule reward (exact match) is scored too, with weight 0: the policy never
sees it, and it decides `val/accuracy` (`data.success_reward`), the measure the reward model is a proxy for.
`val/reward_hacking` flags an evaluation where the held-out reward model score rose while accuracy fell.

    posttrain run recipes/rm_arithmetic.py      # the reward model first (or: dvc repro pipelines/rlhf_arithmetic/dvc.yaml)
    posttrain run recipes/rlhf_arithmetic.py
"""

from recipes.arithmetic import build_config as arithmetic
from rl_core.algorithms.grpo import GRPO
from rl_core.config import PosttrainConfig
from rl_core.config.schema import RewardEntry


def build_config() -> PosttrainConfig:
    cfg = arithmetic()
    cfg.job.name = "rlhf-arithmetic"
    cfg.rl.objective = GRPO()
    cfg.data.rewards = [RewardEntry(model="runs/rm-arithmetic", name="rm"),
                        RewardEntry(path="rl_core.rewards.arithmetic:exact_match", weight=0.0, name="arithmetic")]
    cfg.data.success_reward = "arithmetic"
    return cfg
