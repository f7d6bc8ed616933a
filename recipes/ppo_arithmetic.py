"""PPO with a critic on the quickstart's task: the tiny model learns two-digit addition from one completion per
prompt, the critic's values as its baseline (docs/objectives.md, "PPO"). The quickstart's data, warm start and
schedule (recipes/arithmetic.py), at its generated tokens per step: 128 prompts x 1 completion where it draws
16 x 8.
"""

from recipes.arithmetic import build_config as arithmetic
from rl_core.algorithms.ppo import PPO
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = arithmetic()
    cfg.job.name = "ppo-arithmetic"
    cfg.rollout.n = 1
    cfg.rollout.prompts_per_step = 128
    cfg.rl.objective = PPO(critic_lr=1e-4, critic_warmup_steps=5)
    return cfg
