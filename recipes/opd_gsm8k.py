"""On-policy distillation on GSM8K: Qwen2.5-7B-Instruct teaches Qwen2.5-1.5B-Instruct (GPU, vLLM rollouts).

The two share the Qwen2.5 tokenizer (the teacher scores the student's token ids). The teacher is
frozen and spread over the ranks: a copy beside each trainer rank on its GPU (`cluster.teacher_replicas`,
default one per rank), each scoring a quarter of the batch, so the cluster needs num_workers GPUs; the
memory plan counts ~15 GiB of bf16 teacher weights on each.
The task reward's group advantage is mixed in with a small weight.

    posttrain run recipes/opd_gsm8k.py -- rl.max_steps=100
"""

from rl_core.algorithms.opd import OPD
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "opd-gsm8k"
    cfg.model.name_or_path = "Qwen/Qwen2.5-1.5B-Instruct"
    cfg.model.teacher = "Qwen/Qwen2.5-7B-Instruct"
    cfg.model.compute_dtype = "bfloat16"  # float32 master weights and AdamW state, bf16 forward/backward
    cfg.model.gradient_checkpointing = True
    cfg.rollout.backend = "vllm"
    cfg.rollout.temperature = 1.0
    cfg.rollout.max_tokens = 1024
    cfg.rollout.n = 4
    cfg.rollout.prompts_per_step = 64
    cfg.rl.objective = OPD(distillation_mode="advantage", kl_coef=1.0, discount=0.0, task_reward_weight=0.1,
                           loss_type="token-mean")
    cfg.rl.mini_batch_per_replica = 32  # 2 updates per collected batch on 4 workers
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
