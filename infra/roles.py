"""The driver-side rollout role: tokenizer, rollout engine, datasets, reward and prompt sampler.

Built once per flow run from the config; the flow hands its parts to the phase tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.config import PosttrainConfig
from rl_core.data import Example, PromptSampler, encode_prompts, load_examples
from rl_core.models import load_policy
from rl_core.rewards import reward_fn_from_config
from rl_core.rollout import RolloutEngine, make_engine, sampling_params_from_config


@dataclass
class RolloutRole:
    cfg: PosttrainConfig
    tokenizer: Any
    engine: RolloutEngine
    train: list[Example]
    val: list[Example]
    reward_fn: Callable[[str, str], float]
    sampler: PromptSampler

    @classmethod
    def build(cls, cfg: PosttrainConfig) -> RolloutRole:
        torch.manual_seed(cfg.job.seed)
        model, tokenizer = load_policy(cfg.model)
        model.eval()
        engine = make_engine(cfg.rollout, model, tokenizer, seed=cfg.sampling_seed,
                             model_path=cfg.model.name_or_path, dtype=cfg.model.dtype)
        train = load_examples(cfg.data.train, cfg.data.task)
        val = load_examples(cfg.data.val, cfg.data.task)
        if cfg.rl.validation.max_prompts is not None:
            val = val[: cfg.rl.validation.max_prompts]
        sampler = PromptSampler(len(train), cfg.rollout.prompts_per_step, seed=cfg.job.seed)
        return cls(cfg, tokenizer, engine, train, val, reward_fn_from_config(cfg.data), sampler)

    def prompts(self, rows: list[int]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, [self.train[i] for i in rows], self.cfg.data.task,
                              self.cfg.data.prompt_template)

    def sampling(self, step: int):
        """Sampling parameters of one step: a per-step seed derived from the run's sampling seed."""
        return sampling_params_from_config(self.cfg.rollout, seed=self.cfg.sampling_seed * 1_000_003 + step)
