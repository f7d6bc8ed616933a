"""Group advantages (against worked examples and `rl_core.evaluation.closed_forms`) and the shared-prefix mask."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rl_core.annotators import annotate_group_advantages
from rl_core.annotators.advantage import group_advantages, zero_advantage_group_fraction
from rl_core.annotators.shared_prefix import shared_prefix_loss_mask
from rl_core.batch.trajectory import Trajectory
from rl_core.config import RLConfig
from rl_core.evaluation import closed_forms

EPS = 1e-6


def test_worked_example_pair():
    adv = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    # μ = 0.5, σ (ddof=1) = sqrt(0.5) = 0.7071..., A = ±0.5 / (0.7071 + eps)
    expected = 0.5 / (math.sqrt(0.5) + EPS)
    assert adv.tolist() == pytest.approx([expected, -expected], rel=1e-6)
    assert adv[0].item() == pytest.approx(0.70710, abs=1e-5)


def test_worked_example_four():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([3, 3, 3, 3]))
    assert adv.tolist() == pytest.approx([(r - 0.75) / (0.5 + EPS) for r in (1, 0, 1, 1)], rel=1e-12)
    assert adv.tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)


def test_unbiased_is_mean_centred_only():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0]), unbiased=True)
    assert adv.tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25], abs=1e-7)


def test_random_groups_interleaved_against_closed_form():
    rng = random.Random(0)
    ids = [g for g in range(6) for _ in range(rng.choice([2, 3, 5]))]
    rng.shuffle(ids)  # groups need not be contiguous
    rewards = [rng.choice([0.0, 0.5, 1.0]) + rng.random() for _ in ids]
    for unbiased in (False, True):
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids), unbiased=unbiased,
                               eps=0.01)
        expected = closed_forms.group_advantages(rewards, ids, unbiased=unbiased, eps=0.01)
        assert adv.tolist() == pytest.approx(expected, rel=1e-10)


def test_all_equal_group_is_exactly_zero_and_stays():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, torch.tensor([7, 7, 7, 8, 8]))
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # 0.1 * 3 / 3 != 0.1 in floats: zero by rule, not by luck
    assert adv.shape == (5,) and adv[3] > 0 > adv[4]
    assert zero_advantage_group_fraction(rewards, torch.tensor([7, 7, 7, 8, 8])) == 0.5


def test_group_of_one_is_an_error_naming_the_group():
    with pytest.raises(ValueError, match=r"\[42\]"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1, 1, 42]))


def test_dtype_kept():
    assert group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])).dtype == torch.float32


# ------------------------------------------------------------------------------ shared prefix


def _batch(responses, rewards, groups, prompt=3):
    t = prompt + max(len(r) for r in responses) + 2
    b = len(responses)
    ids = torch.zeros(b, t, dtype=torch.long)
    att = torch.zeros(b, t, dtype=torch.long)
    loss = torch.zeros(b, t)
    for i, resp in enumerate(responses):
        ids[i, :prompt] = 9
        att[i, :prompt + len(resp)] = 1
        ids[i, prompt:prompt + len(resp)] = torch.tensor(resp)
        loss[i, prompt:prompt + len(resp)] = 1
    return ids, loss, torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups)


def _masked_counts(new, old):
    return [int(((old[i] > 0) & (new[i] == 0)).sum()) for i in range(old.shape[0])]


def test_shared_prefix_masks_prefix_of_differently_rewarded_completions():
    responses = [
        [1, 2, 3, 4, 5, 0],  # a: reward 1
        [1, 2, 3, 4, 7, 0],  # b: reward 0, shares 4 with a
        [1, 2, 6, 6, 6, 0],  # c: reward 1, shares 2 with a and b
        [1, 2, 3, 4, 5, 8, 0],  # d: reward 1, same reward as a (shares 5): no masking from a
        [4, 4, 4, 0],  # e: other group
        [4, 4, 5, 0],
    ]
    ids, loss, r, g = _batch(responses, [1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1])
    new = shared_prefix_loss_mask(ids, loss, r, g, min_tokens=3)
    # a, b, d share [1,2,3,4] with b (reward differs) -> 4 masked; c shares only 2 (< 3) -> kept;
    # group 1 has equal rewards -> kept
    assert _masked_counts(new, loss) == [4, 4, 0, 4, 0, 0]
    # the masked tokens are the first ones of each response
    assert torch.equal(new[0, 3:7], torch.zeros(4)) and torch.equal(new[0, 7:9], torch.ones(2))
    # lower threshold: c now shares 2 with the reward-0 completion b
    assert _masked_counts(shared_prefix_loss_mask(ids, loss, r, g, min_tokens=2), loss) == [4, 4, 2, 4, 0, 0]
    assert torch.equal(shared_prefix_loss_mask(ids, loss, r, g, min_tokens=0), loss)


def test_completion_that_is_entirely_the_prefix_keeps_its_tokens():
    responses = [[1, 2, 3], [1, 2, 3, 4, 5]]  # the first is a prefix of the second (truncated, say)
    ids, loss, r, g = _batch(responses, [1, 0], [0, 0])
    new = shared_prefix_loss_mask(ids, loss, r, g, min_tokens=2)
    assert _masked_counts(new, loss) == [0, 3]


def test_annotate_group_advantages_from_config():
    responses = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 6], [7, 7]]
    ids, loss, r, g = _batch(responses, [1, 0, 1, 1], [0, 0, 1, 1])
    b = ids.shape[0]
    batch = Trajectory(ids, (ids != 0).long() | (loss > 0).long(), loss, torch.zeros(loss.shape), r, g,
                       torch.arange(b), 0)
    out, stats = annotate_group_advantages(batch, RLConfig(shared_prefix_min_tokens=3, unbiased_advantage=True))
    assert out.advantages.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert _masked_counts(out.loss_mask, loss) == [3, 3, 0, 0]
    assert stats["zero_adv_group_frac"] == 0.5
    assert stats["shared_prefix_masked_frac"] == pytest.approx(6 / 12)
