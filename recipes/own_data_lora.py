"""Bring your own data and rewards, and train a LoRA adapter: the worked example of docs/data.md.

The tiny model learns two-digit sums asked in chat format (`messages` rows of `data/own-data/*.jsonl`, built by
`dvc repro own_data`, or by `posttrain run` when missing), scored by two TRL-style reward functions of
`examples/own_data.py`: the answer's digits in place (weight 0.8, reads the `answer` column) and a length limit
(weight 0.2, reads `max_chars`); a reward of 1.0 is an exact answer. Only a rank-16 LoRA adapter on every linear layer is trained. Point it at your data with
`data.train=... data.val=...` and at your rewards with `data.rewards=[...]`.
"""

from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "own-data-lora"
    cfg.model.name_or_path = "artifacts/tiny-model/warm"
    cfg.model.lora.r = 16
    cfg.model.lora.alpha = 32.0
    cfg.model.lora.target_modules = "all-linear"
    cfg.rollout.max_tokens = 4  # up to 3 digits + <eos>
    cfg.rollout.n = 8
    cfg.rollout.prompts_per_step = 16
    cfg.rl.max_steps = 60
    cfg.rl.optimizer.lr = 1e-3  # adapters start at B = 0 and take a larger step than full fine-tuning
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 10
    cfg.rl.validation.max_prompts = 200
    cfg.rl.save_every = 20
    cfg.data.task = "prompts"
    cfg.data.train = "data/own-data/train.jsonl"
    cfg.data.val = "data/own-data/val.jsonl"
    cfg.data.prompt_template = "chat"
    cfg.data.rewards = [{"path": "examples.own_data:answer_digits", "weight": 0.8},
                        {"path": "examples.own_data:within_length", "weight": 0.2}]
    return cfg
