"""DPO on CPU: the warm-started tiny model learns from (correct, off-by-one) answer pairs of two-digit addition.

Pairs: `data/arithmetic-pairs/{train,val}.jsonl`, made from the arithmetic train/val splits by
`posttrain make-data arithmetic-pairs` (DVC stage `arithmetic_pairs`; the flow builds them when
missing): chosen = the correct answer, rejected = the answer with one digit moved by ±1.
`rollout.prompts_per_step` is reused as PAIRS PER STEP (2 rows each; it must divide by
`cluster.num_workers` so every worker gets whole pairs); `rollout.n` is not read. The reference is
the frozen initial policy (`rl.reference=None`), scored once before training. `rollout.max_tokens`
bounds the pairs' response length (the pair gate) and the greedy held-out evaluation.
Held-out metrics: `val/loss`, `val/reward_accuracy`, `val/margin` of the val pairs, and
`val/accuracy`, greedy exact match on the val prompts.

    posttrain run recipes/dpo_arithmetic.py
"""

from rl_core.algorithms.dpo import DPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "dpo-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/warm"
    cfg.rollout.max_tokens = 4  # up to 3 answer digits + <eos>
    cfg.rollout.prompts_per_step = 32  # pairs per step
    cfg.rl.objective = DPO(beta=0.1)
    cfg.rl.max_steps = 150
    cfg.rl.optimizer.lr = 3e-5
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 25
    cfg.rl.save_every = 50
    cfg.data.task = "arithmetic"
    cfg.data.train = "data/arithmetic-pairs/train.jsonl"
    cfg.data.val = "data/arithmetic-pairs/val.jsonl"
    cfg.data.prompt_template = "plain"  # a base model that continues `12+34=`: no chat template
    return cfg
