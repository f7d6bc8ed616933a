"""A mixture-of-experts policy on CPU: the quickstart's task and batch, with the tiny Mixtral (4 experts per layer,
top-2) learning two-digit addition by clipped GRPO, the trainer replaying the experts the engine chose for every
sampled token (docs/moe.md).

`dvc repro pipelines/moe_arithmetic/dvc.yaml` builds the model (`artifacts/tiny-moe/init`) and its warm start
(`artifacts/tiny-moe/warm`) from the quickstart's data (`posttrain run` builds them when missing). Two updates per
collected batch (`rl.mini_batch_per_replica`), so the second one's ratio compares the updated policy with the one
that sampled: on the same experts, with `model.routing_replay=rollout`.
"""

from recipes.arithmetic import build_config as build_arithmetic_config
from rl_core.algorithms.grpo import GRPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = build_arithmetic_config()
    cfg.job.name = "moe-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-moe/warm"
    cfg.model.routing_replay = "rollout"
    cfg.rl.objective = GRPO()
    cfg.rl.mini_batch_per_replica = 64  # two updates per batch of 16 prompts x 8 completions
    cfg.rl.max_steps = 200
    return cfg
