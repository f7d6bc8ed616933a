"""An agent with a tool on CPU: the tiny model learns to call a calculator for sums too long to do in its head
(examples/tool_arithmetic.py, docs/agents.md).

`dvc repro pipelines/tool_arithmetic/dvc.yaml` builds the rows, the warm-start games and the warm start
(`artifacts/tiny-model/tool-warm`, with the example's chat template, which renders tools and calls). An episode is at
most `rollout.max_turns` turns of `rollout.max_tokens` tokens: a calculator call, then the answer. The loss is on
the policy's turns only; the calculator's results are read, not trained on.
"""

from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "tool-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/tool-warm"
    cfg.rollout.max_tokens = 96  # a calculator call (~85 characters) and its end
    cfg.rollout.max_turns = 3
    cfg.rollout.max_episode_tokens = 384
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 8
    cfg.rl.max_steps = 150
    cfg.rl.optimizer.lr = 1e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 25
    cfg.rl.validation.max_prompts = 200
    cfg.rl.save_every = 100
    cfg.data.task = "examples.tool_arithmetic:ToolArithmetic"
    cfg.data.train = "data/tool-arithmetic/train.jsonl"
    cfg.data.val = "data/tool-arithmetic/val.jsonl"
    cfg.data.prompt_template = "chat"
    return cfg
