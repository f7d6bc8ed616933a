"""Dynamic sampling (`rollout.filter_groups`, rl_core/batch/dynamic_sampling.py): which groups are useful (the
closed form of the module docstring, computed here by hand), the size of each extra round, the batch the rounds make,
the cap and both fallbacks, the rows the annotate phase leaves out of the loss, and the preflight rules. That a
filtered batch trains as its useful rows given directly is in tests/rl_core/test_trainer.py."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.annotate import annotate
from rl_core.batch.dynamic_sampling import (
    DynamicSampling,
    group_pass_rates,
    group_spread,
    next_round_size,
    round_pass_rates,
    select_groups,
    useful_groups,
)
from rl_core.batch.gate import validate_annotations, validate_batch_tensors
from rl_core.config import RLConfig, load_config
from rl_core.preflight.rules import preflight
from rl_core.rewards import Scores
from tests.builders import scored_round
from tests.conftest import recipe


def test_a_group_is_useful_when_its_rewards_spread_beyond_the_band():
    # by hand: [1, 0, 1, 0] mean 1/2, every deviation 1/2, std 1/2; [1, .9, 1, 1] mean .975, deviations .025, -.075,
    # .025, .025, squares sum .0075, std sqrt(.0075 / 4) = .0433...; equal rewards: 0 exactly (0.1 sums inexactly)
    rewards = [1, 0, 1, 0, 1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1, 1, 0.9, 1, 1]
    groups = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    spread = group_spread(rewards, groups)
    assert spread[0] == 0.5 and spread[1] == 0.0 and spread[2] == 0.0
    assert spread[3] == pytest.approx(math.sqrt(0.0075 / 4), rel=1e-12)
    assert useful_groups(rewards, groups) == {0: True, 1: False, 2: False, 3: True}
    assert useful_groups(rewards, groups, std_min=0.05) == {0: True, 1: False, 2: False, 3: False}
    assert useful_groups(rewards, groups, std_min=0.5) == {0: False, 1: False, 2: False, 3: False}  # s > b, strictly
    assert group_pass_rates([True, False, True, True, False, False], [0, 0, 1, 1, 2, 2]) == {0: 0.5, 1: 1.0, 2: 0.0}


@pytest.mark.parametrize("target, kept, generated, size", [
    (8, 0, 8, 8),     # nothing useful yet: a whole step's worth
    (8, 2, 8, 8),     # ceil(6 * 8 / 2) = 24, capped at 8
    (8, 6, 8, 3),     # ceil(2 * 8 / 6) = ceil(2.67) = 3
    (16, 12, 16, 6),  # ceil(4 * 16 / 12) = ceil(5.33) = 6
    (16, 15, 20, 2),  # ceil(1 * 20 / 15) = ceil(1.33) = 2
    (8, 8, 9, 0),     # enough
])
def test_each_extra_round_draws_what_the_useful_rate_so_far_needs_at_most_a_step(target, kept, generated, size):
    assert next_round_size(target, kept, generated) == size


def tokens(completions, row: int) -> list[int]:
    return [t for t in completions.input_ids[row].tolist() if t != 0]


# round 0: prompts 10..13, n = 2: one useful, one all correct, one all wrong, one useful
FIRST = [[1, 0], [1, 1], [0, 0], [0, 1]]


def test_rounds_gather_the_first_useful_groups_in_generation_order_and_stop_when_there_are_enough():
    picker = DynamicSampling(4, max_rounds=3)
    assert picker.add(scored_round([10, 11, 12, 13], FIRST)) == {0: True, 1: False, 2: False, 3: True}
    assert picker.wants_more() and picker.next_size() == 4  # min(4, ceil(2 * 4 / 2))
    second = scored_round([14, 15, 16, 17], [[1, 1], [0, 1], [1, 0], [0, 1]], seed=1)
    picker.add(second)
    assert picker.useful == 5 and not picker.wants_more()
    selected = picker.select()
    assert selected.rows == [10, 13, 15, 16] and selected.padding == []  # the first 4 of 5 useful; 17 is surplus
    assert selected.completions.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert selected.scores.rewards == [1, 0, 0, 1, 0, 1, 1, 0]
    first = picker.rounds[0].completions
    # each batch row is the round's row (pad ids 0 aside: the rounds are padded to the longest of both)
    for row, (source, i) in enumerate([(first, 0), (first, 1), (first, 6), (first, 7), (second.completions, 2),
                                       (second.completions, 3), (second.completions, 4), (second.completions, 5)]):
        assert tokens(selected.completions, row) == tokens(source, i), row
    assert selected.scores.means == {"rollout/rewards/correct/mean": 0.5}
    stats = picker.stats()
    assert stats == {"rollout/filter/rounds": 1.0, "rollout/filter/generated_prompts": 8.0,
                     "rollout/filter/generated_completions": 16.0,
                     "rollout/filter/generated_tokens": float(first.response_lengths.sum()
                                                              + second.completions.response_lengths.sum()),
                     "rollout/filter/kept_frac": 5 / 8, "rollout/filter/trained_groups": 4.0,
                     "rollout/filter/padded_groups": 0.0, "rollout/filter/skipped_step": 0.0,
                     "rollout/filter/generated_reward_mean": (4 + 5) / 16,  # the rounds sum 4 and 5
                     "rollout/filter/dropped_all_correct": 2.0,
                     "rollout/filter/dropped_all_wrong": 1.0, "rollout/filter/dropped_other": 0.0}


def test_at_the_cap_the_train_fallback_pads_with_dropped_groups_left_out_of_the_loss():
    picker = DynamicSampling(4, max_rounds=1, fallback="train")
    picker.add(scored_round([10, 11, 12, 13], FIRST))
    picker.add(scored_round([14, 15, 16, 17], [[1, 1], [0, 0], [1, 1], [1, 1]], seed=1))  # nothing useful
    assert picker.useful == 2 and not picker.wants_more()  # one extra round: the cap
    selected = picker.select()
    # the 2 useful groups, then the first 2 dropped ones (11: all correct, 12: all wrong) for the batch's shape
    assert selected.rows == [10, 13, 11, 12] and selected.padding == [2, 3]
    assert selected.scores.rewards == [1, 0, 0, 1, 1, 1, 0, 0]
    assert selected.scores.means == {"rollout/rewards/correct/mean": 0.5}  # over the trained groups only
    stats = picker.stats()
    assert (stats["rollout/filter/trained_groups"], stats["rollout/filter/padded_groups"]) == (2.0, 2.0)
    assert (stats["rollout/filter/dropped_all_correct"], stats["rollout/filter/dropped_all_wrong"]) == (4.0, 2.0)
    assert stats["rollout/filter/kept_frac"] == 2 / 8

    out = annotate(selected.completions, selected.scores.rewards, selected.rows, rl=RLConfig(), first_sample_id=0,
                   padding=selected.padding)
    filler = torch.tensor([False] * 4 + [True] * 4)
    assert float(out.batch.loss_mask[filler].sum()) == 0 and bool((out.batch.loss_mask[~filler].sum(1) > 0).all())
    assert out.batch.advantages[filler].abs().sum() == 0 and out.batch.advantages[~filler].abs().sum() > 0
    assert float(out.batch.rollout_logp[filler].abs().sum()) == 0
    assert (out.table["masked_len"] == out.table["response_len"]).tolist() == filler.tolist()
    validate_annotations(out.table, max_tokens=16)  # the gate takes padding rows: left out of the loss by annotate
    validate_batch_tensors(out.batch, out.table, out.sampled)


def test_at_the_cap_the_skip_fallback_trains_nothing_and_no_useful_group_trains_nothing_either_way():
    picker = DynamicSampling(4, max_rounds=2, fallback="skip")
    picker.add(scored_round([10, 11, 12, 13], FIRST))
    for r in (1, 2):
        assert picker.wants_more()
        picker.add(scored_round([20 + r, 30 + r], [[1, 1], [0, 0]], seed=r))
    assert not picker.wants_more() and picker.select() is None
    assert picker.stats()["rollout/filter/skipped_step"] == 1.0
    assert picker.stats()["rollout/filter/trained_groups"] == 0.0
    for fallback in ("train", "skip"):
        nothing = DynamicSampling(2, max_rounds=0, fallback=fallback)
        nothing.add(scored_round([1, 2], [[1, 1], [0, 0]]))
        assert not nothing.wants_more() and nothing.select() is None  # max_rounds=0: no extra round at all
        assert nothing.skipped() and nothing.stats()["rollout/filter/skipped_step"] == 1.0


def test_the_band_drops_groups_that_spread_too_little_and_names_them_neither_correct_nor_wrong():
    picker = DynamicSampling(2, std_min=0.1, max_rounds=0)
    gathered = scored_round([5, 6], [[1.0, 0.9], [1, 0]], successes=[[True, False], [True, False]])
    assert picker.add(gathered) == {0: False, 1: True}  # std .05 <= .1
    assert picker.stats()["rollout/filter/dropped_other"] == 1.0
    selected = picker.select()
    assert selected.padding == [1] and selected.rows == [6, 5]
    out = annotate(selected.completions, selected.scores.rewards, selected.rows, rl=RLConfig(), first_sample_id=0,
                   padding=selected.padding)
    assert out.batch.advantages[2:].abs().sum() == 0  # its own advantages were not zero: annotate zeroes them


def test_select_groups_keeps_rows_in_group_order_and_renumbers_them():
    gathered = scored_round([7, 8, 9], [[1, 0, 1], [0, 0, 1], [1, 1, 1]])
    c = gathered.completions
    picked = select_groups(c, [2, 0])
    assert picked.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and picked.n == 3
    assert torch.equal(picked.input_ids, torch.cat([c.input_ids[6:9], c.input_ids[0:3]]))
    assert picked.finish_reason == c.finish_reason[6:9] + c.finish_reason[0:3]
    assert round_pass_rates(gathered) == ([7, 8, 9], [2 / 3, 1 / 3, 1.0])


def test_scores_of_a_batch_follow_its_rows():
    gathered = scored_round([1, 2], [[1, 0], [0, 1]])
    gathered.scores = Scores([1.0, 0.0, 0.0, 1.0], {}, {"correct": [1.0, 0.0, None, 1.0], "short": [0.5] * 4})
    picker = DynamicSampling(1, max_rounds=0)
    picker.add(gathered)
    selected = picker.select()
    assert selected.rows == [1] and selected.scores.values == {"correct": [1.0, 0.0], "short": [0.5, 0.5]}
    assert selected.scores.means == {"rollout/rewards/correct/mean": 0.5, "rollout/rewards/short/mean": 0.5}


# ------------------------------------------------------------------------------------------ preflight


def errors(*overrides: str, name: str = "arithmetic") -> list[str]:
    return preflight(load_config(recipe(name), list(overrides))).errors


def test_preflight_takes_the_features_where_they_apply_and_refuses_them_elsewhere_naming_both_keys():
    assert errors("rollout.filter_groups=true", "rollout.filter_max_rounds=1", "rollout.filter_fallback=skip",
                  "rollout.filter_reward_std_min=0.1", "data.sampler=curriculum", "data.curriculum_floor=0.1",
                  "data.curriculum_ema=0.3") == []
    asynchronous = ["rl.objective.type=grpo", "cluster.placement=separate", "rl.async_steps=1"]
    assert errors(*asynchronous, "rollout.filter_groups=true", "data.sampler=curriculum") == []
    dpo = errors("rollout.filter_groups=true", "data.sampler=curriculum", name="dpo_arithmetic")
    assert any("rollout.filter_groups=true with rl.objective.type=dpo" in e for e in dpo)
    assert any("data.sampler=curriculum with rl.objective.type=dpo" in e for e in dpo)
    assert any("rollout.filter_groups=true with rl.objective.type=opd" in e
               for e in errors("rollout.filter_groups=true", name="opd_arithmetic"))


def test_a_knob_of_a_feature_that_is_off_is_refused_naming_the_switch():
    switch = {"rollout": "remove it or set rollout.filter_groups=true", "data": "remove it or set data.sampler=curriculum"}
    assert errors("rollout.filter_max_rounds=5", "rollout.filter_fallback=skip", "data.curriculum_ema=0.3") == [
        f"rollout.filter_max_rounds=5: read only by rollout.filter_groups=true; {switch['rollout']}",
        f"rollout.filter_fallback='skip': read only by rollout.filter_groups=true; {switch['rollout']}",
        f"data.curriculum_ema=0.3: read only by data.sampler=curriculum; {switch['data']}"]
