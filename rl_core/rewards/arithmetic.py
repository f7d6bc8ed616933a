"""Arithmetic reward: exact match of the completion (text up to EOS, whitespace-stripped) with the answer."""

from __future__ import annotations


def arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 iff `completion.strip() == answer.strip()` and the answer is not empty, else 0.0.

    `completion` is the decoded response up to (not including) EOS; no substring or prefix
    matching: "46" scores against "46", "46 " scores, "460" and "46+1" do not.
    """
    expected = str(answer).strip()
    if not expected:
        return 0.0
    return 1.0 if completion.strip() == expected else 0.0


def exact_match(prompts, completions, answer, **_) -> list[float]:
    """`arithmetic_reward` as a TRL-style reward function (`data.rewards` entry `rl_core.rewards.arithmetic:exact_match`),
    the arithmetic task's own reward by import path."""
    from rl_core.rewards import completion_text

    return [arithmetic_reward(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]
