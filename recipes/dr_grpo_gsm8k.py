"""Dr-GRPO on GSM8K: GRPO's recipe with mean-centred advantages and the fixed divisor (docs/objectives.md).

Config only: `rl.objective.type=dr_grpo` fixes `unbiased_advantage=true` and
`loss_type=seq-mean-token-sum-fixed`, whose divisor is `rollout.max_tokens`; the clip range is GRPO's.
"""

from recipes.grpo_gsm8k import build_config as build_grpo_config
from rl_core.algorithms.grpo import DrGRPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = build_grpo_config()
    cfg.job.name = "dr-grpo-gsm8k"
    grpo = cfg.rl.objective
    cfg.rl.objective = DrGRPO(epsilon_low=grpo.epsilon_low, epsilon_high=grpo.epsilon_high,
                              lower_bound_ratio=grpo.lower_bound_ratio)
    return cfg
