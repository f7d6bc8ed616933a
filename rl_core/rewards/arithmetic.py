"""Arithmetic reward: exact match of the completion (text up to EOS, whitespace-stripped) with the answer."""

from __future__ import annotations

# The arithmetic judge's request (`data.rewards` entry `{judge: {template: ...}}` of recipes/judge_arithmetic.py and
# the rows `posttrain make-data arithmetic-judge` teaches it): the problem, the response and the reference answer;
# the judge answers 1 (the response is the reference) or 0. A reference-guided judge: the tiny model does not learn
# to judge a sum it is not shown (docs/rewards.md).
JUDGE_TEMPLATE = "{prompt}{completion}|{answer}?"


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
