"""User code the tests plug in by import path (`data.custom_reward`) and wrong user code they must refuse, as a
user's would be: outside the package. The example objective the tests train is `examples/custom_objective.py`.
"""

from __future__ import annotations

import torch


def answer_length_reward(completion: str, answer: str) -> float:
    """A reward a test can recompute from the data to within 1e-3: the answer's length / 10, plus 1e-3 for a
    completion of odd length (so a group's rewards differ and its advantages are not all 0)."""
    return len(answer) / 10 + 1e-3 * (len(completion) % 2)


# ------------------------------------------------------------------------------------------ wrong ones

def objective_with_one_argument(rl):
    raise AssertionError("never called: the signature check refuses it")


def reward_with_three_arguments(completion, answer, extra):
    raise AssertionError("never called: the signature check refuses it")


def not_an_objective(rl, context):
    return torch.zeros(())


NOT_A_FUNCTION = 3
