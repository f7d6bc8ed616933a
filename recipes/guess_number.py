"""An agent on CPU: the tiny model plays guess-the-number over several turns (examples/guess_number.py,
docs/agents.md).

`dvc repro pipelines/guess_number/dvc.yaml` builds the rows and the warm start (`artifacts/tiny-model/guess-warm`:
the game's format, from games a quarter of which heed the replies). `data.task` names the environment class: each
row is one game, `rollout.n` games per row a step, each at most `rollout.max_turns` guesses of `rollout.max_tokens`
tokens (a digit and the end of the turn). The loss is on the policy's guesses only; the environment's replies
("higher: 4-6") are read, not trained on. Held-out greedy success rises from 0.36 to 1.00 in the 200 steps
(docs/benchmarks.md).
"""

from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "guess-number"
    cfg.model.name_or_path = "artifacts/tiny-model/guess-warm"
    cfg.rollout.max_tokens = 2  # a digit and <eos>
    cfg.rollout.max_turns = 4
    cfg.rollout.max_episode_tokens = 256
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 16
    cfg.rl.max_steps = 200
    cfg.rl.optimizer.lr = 5e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 20
    cfg.rl.validation.max_prompts = 200
    cfg.rl.save_every = 100
    cfg.data.task = "examples.guess_number:GuessNumber"
    cfg.data.train = "data/guess-number/train.jsonl"
    cfg.data.val = "data/guess-number/val.jsonl"
    cfg.data.prompt_template = "chat"
    # the environment's reward (found it or not) decides the held-out success; a TRL-style reward over the
    # conversation adds credit for each guess that heeds the replies
    cfg.data.rewards = [{"path": "examples.guess_number:heeds_replies", "weight": 0.3}]
    return cfg
