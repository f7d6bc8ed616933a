"""Sampling seeds: one per completion row, so that a row's tokens depend on its own seed, its context and the
weights, never on the other rows of its engine call or on how a step's prompts were sharded over engines."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_core.rollout.base import SamplingParams

SEED_MODULUS = 2**63 - 1


def completion_seeds(seed: int, prompt_offset: int, num_prompts: int, n: int) -> list[int]:
    """One seed per completion: row `i*n + k` (prompt `prompt_offset + i` of the step, sample `k`).

    A splitmix64-style mix of (seed, prompt position, sample index), so that seeds of neighbouring
    rows are unrelated (vLLM would otherwise give child k of every prompt the same stream) and
    non-negative below 2**63 (what torch generators and vLLM accept).
    """
    out = []
    for i in range(num_prompts):
        for k in range(n):
            x = (int(seed) * 0x9E3779B97F4A7C15 + (prompt_offset + i) * 0xBF58476D1CE4E5B9 + k * 0x94D049BB133111EB)
            x &= 0xFFFFFFFFFFFFFFFF
            x ^= x >> 30
            x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
            x ^= x >> 27
            x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
            x ^= x >> 31
            out.append(x % SEED_MODULUS)
    return out


def sampling_seeds(sampling: SamplingParams, prompt_offset: int, num_prompts: int, n: int) -> list[int] | None:
    """Each completion row's seed for one `generate` call: `sampling.row_seeds` (one per row, `n=1`), or derived from
    `sampling.seed` (`completion_seeds`); None when greedy or without a seed (the engine's own generator)."""
    if sampling.seed is None or sampling.is_greedy:
        return None
    if sampling.row_seeds is None:
        return completion_seeds(sampling.seed, prompt_offset, num_prompts, n)
    if n != 1 or len(sampling.row_seeds) != num_prompts:
        raise ValueError(f"row_seeds: {len(sampling.row_seeds)} seeds for {num_prompts} prompt(s) x n={n}; give one "
                         "seed per prompt, with n=1")
    return list(sampling.row_seeds)
