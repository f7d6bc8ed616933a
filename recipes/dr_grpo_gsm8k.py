"""Dr-GRPO on GSM8K: GRPO's recipe with mean-centred advantages and the fixed divisor (docs/objectives.md).

Config only: `rl.unbiased_advantage=true` + `rl.loss_type=seq-mean-token-sum-fixed`, whose divisor is
`rollout.max_tokens`.
"""

from recipes.grpo_gsm8k import build_config as build_grpo_config
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = build_grpo_config()
    cfg.job.algorithm = "dr_grpo"
    cfg.job.name = "dr-grpo-gsm8k"
    cfg.rl.unbiased_advantage = True
    cfg.rl.loss_type = "seq-mean-token-sum-fixed"
    return cfg
