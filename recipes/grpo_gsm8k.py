"""Clipped GRPO on GSM8K with Qwen2.5-3B-Instruct: the production recipe (GPU cluster, vLLM rollouts)."""

from rl_core.algorithms.grpo import GRPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "grpo-gsm8k"
    cfg.model.name_or_path = "Qwen/Qwen2.5-3B-Instruct"
    cfg.model.compute_dtype = "bfloat16"  # float32 master weights and AdamW state, bf16 forward/backward
    cfg.model.gradient_checkpointing = True
    cfg.rollout.backend = "vllm"
    cfg.rollout.temperature = 1.0
    cfg.rollout.max_tokens = 1024
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 64
    cfg.rl.objective = GRPO(epsilon_low=0.2, epsilon_high=0.28, lower_bound_ratio=3.0, loss_type="token-mean")  # clip-higher
    cfg.rl.mini_batch_per_replica = 32  # 4 updates per collected batch on 4 workers
    cfg.rl.micro_batch_per_replica = 8
    cfg.rl.max_steps = 200
    cfg.rl.save_every = 20
    cfg.rl.optimizer.lr = 1e-6
    cfg.rl.optimizer.warmup_steps = 10
    cfg.rl.validation.every_steps = 20
    cfg.rl.validation.max_prompts = 500
    cfg.data.task = "gsm8k"
    cfg.data.train = "data/gsm8k/train.jsonl"
    cfg.data.val = "data/gsm8k/test.jsonl"
    cfg.data.prompt_template = "chat"
    cfg.data.reward_mode = "strict"
    cfg.cluster.num_workers = 4
    cfg.cluster.gpus_per_worker = 1.0
    cfg.cluster.sharding = "fsdp"  # parameters, gradients and optimizer state split over the 4 ranks
    cfg.cluster.cpus_per_worker = 4.0
    return cfg
