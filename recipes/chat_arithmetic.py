"""Chat data and TRL-style rewards on CPU: the tiny model learns sums asked as conversations.

The rows are TRL's conversational format (`prompt` = a system and a user message, extra columns `solution` and
`difficulty`; `examples/chat_arithmetic.py` builds them), scored by `accuracy_reward` (weight 1.0) and
`format_reward` (weight 0.2) written as TRL writes them. The model is the tiny warm start after a short warm start
on conversations (`artifacts/tiny-model/chat`): it knows the turn format and answers a few sums in it; GRPO does
the rest. Build both with `dvc repro pipelines/chat_arithmetic/dvc.yaml` (docs/data.md).
"""

from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "chat-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/chat"
    cfg.rollout.max_tokens = 4  # up to 3 answer digits + <eos>
    cfg.rollout.n = 16  # a group of 16 finds a right answer to learn from where the start answers few
    cfg.rollout.prompts_per_step = 16
    cfg.rl.max_steps = 100
    cfg.rl.optimizer.lr = 1e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 20
    cfg.rl.validation.max_prompts = None  # the whole held-out split (200 conversations)
    cfg.rl.save_every = 50
    cfg.data.task = "prompts"
    cfg.data.train = "data/chat-arithmetic/train.jsonl"
    cfg.data.val = "data/chat-arithmetic/val.jsonl"
    cfg.data.prompt_template = "chat"
    cfg.data.rewards = [{"path": "examples.chat_arithmetic:accuracy_reward", "weight": 1.0},
                        {"path": "examples.chat_arithmetic:format_reward", "weight": 0.2}]
    cfg.data.success_reward = "accuracy_reward"  # val/accuracy: exact sums, whatever the weights
    return cfg
