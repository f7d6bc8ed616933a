"""The CPU quickstart and the root default: the tiny model learns two-digit addition.

Pins the legacy policy-gradient surrogate (docs/objectives.md): on-policy, one update per rollout,
sampling at temperature 1.0.
"""

from rl_core.algorithms.grpo import LegacyPG
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/warm"
    cfg.rollout.max_tokens = 4  # up to 3 answer digits + <eos>
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 16  # 128 completions a step: prompt diversity beats a larger group here
    cfg.rl.objective = LegacyPG()
    cfg.rl.max_steps = 300
    cfg.rl.optimizer.lr = 1e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 25
    cfg.rl.validation.max_prompts = None  # the whole held-out split (500 sums)
    cfg.rl.save_every = 100
    cfg.data.task = "arithmetic"
    cfg.data.train = "data/arithmetic/train.jsonl"
    cfg.data.val = "data/arithmetic/val.jsonl"
    cfg.data.prompt_template = "plain"  # a base model that continues `12+34=`: no chat template
    return cfg
