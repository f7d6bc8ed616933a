"""On-policy distillation on CPU: the warm-started tiny model (student) learns from a further-trained copy.

Student: `artifacts/tiny-model/warm` (held-out greedy accuracy 0.722). Teacher:
`artifacts/tiny-model/teacher`, the warm start trained for `teacher_warm_start.steps` more
supervised steps of params.yaml (0.950; DVC stage `teacher_warm_start`, built by the flow when
missing, or by hand: `posttrain warm-start --init artifacts/tiny-model/warm --out
artifacts/tiny-model/teacher --steps 600`); it shares the tokenizer.
The student samples 4 completions per prompt; the teacher scores every sampled token; the per-token
advantage `−(ℓ^old − ℓ^teacher)` trains through the clipped surrogate (`rl.objective.distillation_mode=advantage`).

    posttrain run recipes/opd_arithmetic.py -- rl.max_steps=40
"""

from rl_core.algorithms.opd import OPD
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    cfg = PosttrainConfig()
    cfg.job.name = "opd-arithmetic"
    cfg.model.name_or_path = "artifacts/tiny-model/warm"
    cfg.model.teacher = "artifacts/tiny-model/teacher"
    cfg.rollout.max_tokens = 4  # up to 3 answer digits + <eos>
    cfg.rollout.temperature = 1.0  # also the trainer's and the teacher's log-prob temperature
    cfg.rollout.n = 4
    cfg.rollout.prompts_per_step = 16
    # discount 1: an early wrong digit is charged with the teacher's disagreement that follows it
    cfg.rl.objective = OPD(distillation_mode="advantage", kl_coef=1.0, discount=1.0, loss_type="token-mean")
    cfg.rl.max_steps = 60
    cfg.rl.optimizer.lr = 1e-4  # 2e-4 oscillated with this sharp teacher (0.72 -> 0.80 -> 0.71 at steps 0/40/60)
    cfg.rl.optimizer.max_grad_norm = 1.0
    cfg.rl.validation.every_steps = 20
    cfg.rl.validation.max_prompts = 200
    cfg.rl.save_every = 20
    cfg.data.task = "arithmetic"
    cfg.data.train = "data/arithmetic/train.jsonl"
    cfg.data.val = "data/arithmetic/val.jsonl"
    cfg.data.prompt_template = "plain"  # a base model that continues `12+34=`: no chat template
    return cfg
