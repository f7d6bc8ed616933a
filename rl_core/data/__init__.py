"""Datasets as files: the arithmetic builder, GSM8K preparation, JSONL reading, DPO preference pairs and the
seeded prompt samplers (the epoch order and the curriculum). Loading examples and encoding prompts go through
their task (`rl_core.tasks`)."""

from __future__ import annotations

from rl_core.data.arithmetic import make_arithmetic_data, split_arithmetic
from rl_core.data.curriculum import CurriculumSampler
from rl_core.data.gsm8k import prepare_gsm8k
from rl_core.data.sampler import PromptSampler, build_sampler

__all__ = [
    "CurriculumSampler",
    "PromptSampler",
    "build_sampler",
    "make_arithmetic_data",
    "prepare_gsm8k",
    "split_arithmetic",
]
