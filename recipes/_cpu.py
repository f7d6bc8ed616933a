"""Shrink a GSM8K recipe to the tiny model on CPU: every phase runs, nothing is learned."""

from rl_core.config import PosttrainConfig


def cpu_variant(cfg: PosttrainConfig) -> PosttrainConfig:
    cfg.job.name = f"{cfg.job.name}-cpu"
    cfg.model.name_or_path = "artifacts/tiny-model/warm"
    cfg.model.compute_dtype = "float32"
    cfg.model.gradient_checkpointing = False
    cfg.rollout.backend = "hf"
    cfg.rollout.max_tokens = 16
    cfg.rollout.n = 4
    cfg.rollout.prompts_per_step = 2
    cfg.data.prompt_template = "plain"
    cfg.cluster.num_workers = 1
    cfg.cluster.sharding = "none"
    cfg.cluster.gpus_per_worker = 0.0
    cfg.cluster.cpus_per_worker = 1.0
    cfg.rl.mini_batch_per_replica = 4 if cfg.rl.mini_batch_per_replica else None
    cfg.rl.micro_batch_per_replica = None
    cfg.rl.max_steps = 2
    cfg.rl.save_every = 1
    cfg.rl.optimizer.warmup_steps = 0
    cfg.rl.validation.every_steps = 1
    cfg.rl.validation.max_prompts = 4
    return cfg
