"""A reward model on CPU: a tiny model learns to score right answers of two-digit addition above wrong ones
(docs/rewards.md). The first half of the RLHF example: recipes/rlhf_arithmetic.py trains the policy with this model as
its only reward.

Pairs: `data/arithmetic-rm-pairs/{train,val}.jsonl`, from `posttrain make-data arithmetic-pairs --model
artifacts/tiny-model/warm --samples 8 --out data/arithmetic-rm-pairs` (DVC stage `rm_pairs` of
pipelines/rlhf_arithmetic/dvc.yaml): chosen = the correct answer, rejected = one of eight answers the warm model
samples (off by one digit where the sample is right; an answer the 4-token limit cut included, as the reward model
will read it, with EOS), so the model learns the mistakes the policy makes. The
backbone is the tiny teacher's (`artifacts/tiny-model/teacher`: the warm start trained further, as OPD's teacher), a
stronger model than the policy it will judge, as a reward model usually is; its score head is new (0: every score
starts at 0, `val/loss` = log 2). Held-out metrics:
`val/loss`, `val/accuracy` (the fraction of held-out pairs ranked right), `val/margin`. The final model
(`runs/rm-arithmetic/final_model`) is an `AutoModelForSequenceClassification`.

    posttrain run recipes/rm_arithmetic.py
"""

from rl_core.algorithms.reward_model import RewardModel
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "rm-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/teacher"
    cfg.rollout.max_tokens = 5  # the pair gate's bound: a policy's answer cut at 4 tokens, + <eos> (as it is scored)
    cfg.rollout.prompts_per_step = 64  # pairs per step
    cfg.rl.objective = RewardModel()
    cfg.rl.max_steps = 4000
    cfg.rl.optimizer.lr = 3e-4
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 500
    cfg.rl.save_every = 1000
    cfg.data.task = "arithmetic"
    cfg.data.train = "data/arithmetic-rm-pairs/train.jsonl"
    cfg.data.val = "data/arithmetic-rm-pairs/val.jsonl"
    cfg.data.prompt_template = "plain"  # a base model that continues `12+34=`: no chat template
    return cfg
