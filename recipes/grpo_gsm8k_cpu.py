"""CPU-sized grpo_gsm8k: the tiny model on a few GSM8K problems, so the recipe runs end to end on a laptop."""

from recipes._cpu import cpu_variant
from recipes.grpo_gsm8k import build_config as build_gpu_config
from rl_core.config import PosttrainConfig


def build_config() -> PosttrainConfig:
    return cpu_variant(build_gpu_config())
