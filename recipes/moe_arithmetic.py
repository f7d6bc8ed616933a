"""A mixture-of-experts policy on CPU: the tiny Mixtral (4 experts per layer, top-2) learns two-digit addition with
clipped GRPO, the trainer replaying the experts the engine chose for every sampled token (docs/moe.md).

`dvc repro pipelines/moe_arithmetic/dvc.yaml` builds the model (`artifacts/tiny-moe/init`) and its warm start
(`artifacts/tiny-moe/warm`) from the quickstart's data. Two updates per collected batch
(`rl.mini_batch_per_replica`), so the second one's ratio compares the updated policy with the one that sampled: on
the same experts, with `model.routing_replay=rollout`.
"""

from rl_core.algorithms.grpo import GRPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "moe-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-moe/warm"
    cfg.model.routing_replay = "rollout"
    cfg.rollout.max_tokens = 4  # up to 3 answer digits + <eos>
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 16
    cfg.rl.objective = GRPO()
    cfg.rl.mini_batch_per_replica = 64  # two updates per batch of 128 completions
    cfg.rl.max_steps = 200
    cfg.rl.optimizer.lr = 1e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 25
    cfg.rl.validation.max_prompts = None  # the whole held-out split (500 sums)
    cfg.rl.save_every = 100
    cfg.data.task = "arithmetic"
    cfg.data.train = "data/arithmetic/train.jsonl"
    cfg.data.val = "data/arithmetic/val.jsonl"
    cfg.data.prompt_template = "plain"
    return cfg
