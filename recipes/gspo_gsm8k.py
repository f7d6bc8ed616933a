"""GSPO on GSM8K: clipped GRPO with sequence-level importance ratios (docs/objectives.md)."""

from recipes.grpo_gsm8k import build_config as build_grpo_config
from rl_core.config import PosttrainConfig, RLConfig


def apply_gspo_knobs(rl: RLConfig, mini_batch_per_replica: int) -> RLConfig:
    """The one place that turns a clipped rl section into GSPO (the paper's knobs); returns a copy."""
    rl = rl.model_copy(deep=True)
    rl.grpo_surrogate = "clipped"
    rl.importance_sampling_level = "sequence"
    rl.lower_bound_ratio = 0.0  # no dual clip at sequence level
    rl.epsilon_low = 3e-4
    rl.epsilon_high = 4e-4
    rl.loss_type = "seq-mean-token-mean"
    rl.certified_deterministic_forward = True
    rl.mini_batch_per_replica = mini_batch_per_replica
    return rl


def build_config() -> PosttrainConfig:
    cfg = build_grpo_config()
    cfg.job.algorithm = "gspo"
    cfg.job.name = "gspo-gsm8k"
    # bf16 matmuls; the log-softmax, log-probs and sequence ratios are float32 whatever the compute dtype
    # (rl_core.primitives.logprobs), so the ratio stays within the tolerance tests/rl_core/test_logprobs.py states.
    cfg.model.compute_dtype = "bfloat16"
    cfg.rl = apply_gspo_knobs(cfg.rl, mini_batch_per_replica=32)
    return cfg
