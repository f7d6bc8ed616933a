"""Datasets as files: the arithmetic builder, GSM8K preparation, JSONL reading, DPO preference pairs and the
seeded prompt sampler. Loading examples and encoding prompts go through their task (`rl_core.tasks`)."""

from __future__ import annotations

from rl_core.data.arithmetic import make_arithmetic_data, split_arithmetic
from rl_core.data.gsm8k import prepare_gsm8k
from rl_core.data.sampler import PromptSampler

__all__ = [
    "PromptSampler",
    "make_arithmetic_data",
    "prepare_gsm8k",
    "split_arithmetic",
]
