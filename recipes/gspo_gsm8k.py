"""GSPO on GSM8K: clipped GRPO with sequence-level importance ratios (docs/objectives.md).

`rl.objective.type=gspo` carries the paper's knobs: sequence ratios, clip range 3e-4/4e-4, no dual clip,
the seq-mean-token-mean reduction and the certified pi_old forward.
"""

from recipes.grpo_gsm8k import build_config as build_grpo_config
from rl_core.algorithms.grpo import GSPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = build_grpo_config()
    cfg.job.name = "gspo-gsm8k"
    # bf16 matmuls; the log-softmax, log-probs and sequence ratios are float32 whatever the compute dtype
    # (rl_core.primitives.logprobs), so the ratio stays within the tolerance tests/rl_core/test_logprobs.py states.
    cfg.model.compute_dtype = "bfloat16"
    cfg.rl.objective = GSPO()
    cfg.rl.mini_batch_per_replica = 32  # several updates per batch: a sequence ratio is inert at one
    return cfg
