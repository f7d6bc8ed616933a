"""DPO on GSM8K-style preference pairs with Qwen2.5-1.5B-Instruct (GPU).

Pairs: JSONL files with `prompt` (the question), `chosen` and `rejected` (full solutions), e.g.
chosen = the reference solution ending in `#### N` and rejected = a wrong sampled solution, in
`data/gsm8k-pairs/{train,val}.jsonl`; or any hub dataset with those columns as `org/name:split`
(needs the `datasets` package), e.g. `data.train=<org>/<gsm8k-preference-pairs>:train`.
`rollout.prompts_per_step` is PAIRS PER STEP; `rollout.max_tokens` bounds response length (the
pair gate refuses longer pairs) and the greedy held-out evaluation, which runs on the val pairs
whose chosen response has a `#### N` answer. The reference is the frozen initial policy.

    posttrain run recipes/dpo_gsm8k.py -- rl.max_steps=200
"""

from rl_core.algorithms.dpo import DPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "dpo-gsm8k"
    cfg.model.name_or_path = "Qwen/Qwen2.5-1.5B-Instruct"
    cfg.model.compute_dtype = "bfloat16"  # float32 master weights and AdamW state, bf16 forward/backward
    cfg.model.gradient_checkpointing = True
    cfg.rollout.backend = "vllm"
    cfg.rollout.max_tokens = 1024
    cfg.rollout.prompts_per_step = 64  # pairs per step: 16 per worker
    cfg.rl.objective = DPO(beta=0.1)
    cfg.rl.mini_batch_per_replica = 16  # rows (8 pairs): 2 updates per step
    cfg.rl.micro_batch_per_replica = 4  # rows (2 pairs)
    cfg.rl.max_steps = 300
    cfg.rl.save_every = 50
    cfg.rl.optimizer.lr = 5e-7
    cfg.rl.optimizer.warmup_steps = 10
    cfg.rl.validation.every_steps = 50
    cfg.rl.validation.max_prompts = 500
    cfg.data.task = "gsm8k"
    cfg.data.train = "data/gsm8k-pairs/train.jsonl"
    cfg.data.val = "data/gsm8k-pairs/val.jsonl"
    cfg.data.prompt_template = "chat"
    cfg.cluster.num_workers = 4
    cfg.cluster.gpus_per_worker = 1.0
    cfg.cluster.sharding = "fsdp"  # parameters, gradients and optimizer state split over the 4 ranks
    cfg.cluster.cpus_per_worker = 4.0
    return cfg
