"""The driver-side rollout role: tokenizer, datasets, reward and prompt sampler (no model weights).

Built once per flow run from the config; the flow hands its parts to the phase tasks. The rollout
engines themselves are Ray actors (`infra.cluster.Cluster.engines`): the driver only encodes and
shards prompts, gathers completions and scores them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_core.config import PosttrainConfig
from rl_core.data import Example, PromptSampler, encode_prompts, load_examples
from rl_core.models import load_tokenizer
from rl_core.rewards import reward_fn_from_config
from rl_core.rollout import sampling_params_from_config


@dataclass
class RolloutRole:
    cfg: PosttrainConfig
    tokenizer: Any
    train: list[Example]
    val: list[Example]
    reward_fn: Callable[[str, str], float]
    sampler: PromptSampler
    prompt_limit: int  # the longest encoded prompt of both splits, in tokens

    @classmethod
    def build(cls, cfg: PosttrainConfig) -> RolloutRole:
        tokenizer = load_tokenizer(cfg.model)
        train = load_examples(cfg.data.train, cfg.data.task)
        val = load_examples(cfg.data.val, cfg.data.task)
        if cfg.rl.validation.max_prompts is not None:
            val = val[: cfg.rl.validation.max_prompts]
        sampler = PromptSampler(len(train), cfg.rollout.prompts_per_step, seed=cfg.job.seed)
        lengths = encode_prompts(tokenizer, train + val, cfg.data.task, cfg.data.prompt_template)
        limit = max(len(ids) for ids in lengths)
        return cls(cfg, tokenizer, train, val, reward_fn_from_config(cfg.data), sampler, limit)

    @property
    def max_model_len(self) -> int:
        """What an engine must hold: the longest prompt plus `rollout.max_tokens`."""
        return self.prompt_limit + self.cfg.rollout.max_tokens

    def prompts(self, rows: list[int]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, [self.train[i] for i in rows], self.cfg.data.task,
                              self.cfg.data.prompt_template)

    def sampling(self, step: int):
        """Sampling parameters of one step: a per-step seed derived from the run's sampling seed."""
        return sampling_params_from_config(self.cfg.rollout, seed=self.cfg.sampling_seed * 1_000_003 + step)
