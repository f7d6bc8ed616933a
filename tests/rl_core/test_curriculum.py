"""The prompt samplers' shared interface and the curriculum sampler (rl_core/data/curriculum.py): its weights against
the closed form, computed here by hand, its pass-rate table, its draws' frequencies, and its state round trip (the
draws after a restore, through the checkpoint's own encoding, equal the uninterrupted draws)."""

from __future__ import annotations

import numpy as np
import pytest

from rl_core.data import CurriculumSampler, PromptSampler, build_sampler
from rl_core.data.curriculum import curriculum_weights


def test_weights_are_the_floor_plus_the_success_variance_normalised():
    # by hand, floor 0.05: p = 0, 1/2, 1, 1/4 -> w = .05, .05 + .25, .05, .05 + 3/16 = .05, .30, .05, .2375; sum .6375
    q = curriculum_weights(np.array([0.0, 0.5, 1.0, 0.25]), 0.05)
    assert q.tolist() == pytest.approx([0.05 / 0.6375, 0.30 / 0.6375, 0.05 / 0.6375, 0.2375 / 0.6375], rel=1e-12)
    sampler = CurriculumSampler(4, 2, seed=0, floor=0.05)
    assert sampler.probabilities().tolist() == [0.25] * 4  # every prompt unseen: the prior 1/2, equal weights


def test_the_pass_rate_is_the_first_observation_then_an_exponential_moving_average():
    sampler = CurriculumSampler(3, 1, floor=0.1, ema=0.25)
    sampler.observe([0, 1], [1.0, 0.5])
    assert sampler.pass_rate.tolist() == [1.0, 0.5, 0.5] and sampler.seen.tolist() == [True, True, False]
    sampler.observe([0], [0.0])  # .75 * 1 + .25 * 0
    sampler.observe([0], [1.0])  # .75 * .75 + .25 * 1 = .8125
    assert sampler.pass_rate[0] == 0.8125
    # w = .1 + .8125 * .1875, .1 + .25, .1 + .25
    w = [0.1 + 0.8125 * 0.1875, 0.35, 0.35]
    assert sampler.probabilities().tolist() == pytest.approx([x / sum(w) for x in w], rel=1e-12)
    with pytest.raises(ValueError, match=r"pass rate 1.5 of prompt 2 is outside \[0, 1\]"):
        sampler.observe([2], [1.5])


def test_draws_follow_the_weights_and_no_prompt_is_starved():
    sampler = CurriculumSampler(4, 1, seed=3, floor=0.05)
    sampler.observe([0, 1, 2, 3], [0.0, 0.5, 1.0, 0.25])
    q = sampler.probabilities()
    draws = [sampler.next_batch()[0] for _ in range(40_000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - q).max() < 0.01, (freq, q)  # 3 sigma of a share near .47 over 40k draws is .0075
    assert freq.min() > 0.07  # never solved and always solved: drawn at the floor's rate, q = .078


def test_a_batch_is_distinct_prompts_and_more_than_the_pool_takes_whole_pools():
    sampler = CurriculumSampler(10, 4, seed=1)
    for _ in range(20):
        batch = sampler.next_batch()
        assert len(batch) == len(set(batch)) == 4 and all(0 <= i < 10 for i in batch)
    big = sampler.next_batch(23)
    assert len(big) == 23 and sorted(big[:10]) == list(range(10)) and sorted(big[10:20]) == list(range(10))


def test_restored_state_draws_exactly_what_the_uninterrupted_sampler_draws():
    """Five steps of draw-then-observe; the state after step 2, encoded as a checkpoint's driver part is
    (infra.checkpoints.format) and decoded, restored into a sampler of another seed's history, draws steps 3..5 as
    the uninterrupted one does."""
    from infra.checkpoints.format import flatten_state, unflatten_state

    def step(sampler, s):
        rows = sampler.next_batch()
        sampler.observe(rows, [((r * 7 + s) % 5) / 4 for r in rows])  # a deterministic pass rate per prompt
        return rows

    straight = CurriculumSampler(50, 6, seed=11, floor=0.02, ema=0.3)
    draws = [step(straight, s) for s in range(1, 6)]
    first = CurriculumSampler(50, 6, seed=11, floor=0.02, ema=0.3)
    for s in (1, 2):
        step(first, s)
    saved = unflatten_state(*flatten_state(first.state_dict()))
    resumed = CurriculumSampler(50, 6, seed=11, floor=0.02, ema=0.3)
    step(resumed, 99)  # another history: everything must come from the state
    resumed.load_state_dict(saved)
    assert [step(resumed, s) for s in (3, 4, 5)] == draws[2:]
    assert resumed.pass_rate.tobytes() == straight.pass_rate.tobytes()
    assert resumed.rng.bit_generator.state == straight.rng.bit_generator.state
    # control: without the restore the draws differ, so the check has teeth
    other = CurriculumSampler(50, 6, seed=11, floor=0.02, ema=0.3)
    step(other, 99)
    assert [step(other, s) for s in (3, 4, 5)] != draws[2:]


def test_a_state_of_another_sampler_or_knob_is_refused():
    state = CurriculumSampler(5, 2, seed=1, floor=0.1).state_dict()
    with pytest.raises(ValueError, match="floor=0.1 but this sampler has 0.05"):
        CurriculumSampler(5, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="a curriculum sampler's; resume with the data.sampler"):
        PromptSampler(5, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="not a curriculum sampler's"):
        CurriculumSampler(5, 2, seed=1).load_state_dict(PromptSampler(5, 2, seed=1).state_dict())
    with pytest.raises(ValueError, match="must be > 0"):
        CurriculumSampler(5, 2, floor=0.0)


def test_the_epoch_sampler_takes_counts_from_the_same_stream_and_ignores_observations():
    a, b = PromptSampler(7, 3, seed=4), PromptSampler(7, 3, seed=4)
    assert a.next_batch() + a.next_batch(5) + a.next_batch(1) == b.next_batch(9)
    a.observe([0, 1], [1.0, 0.0])
    assert a.state_dict() == b.state_dict()


def test_build_sampler_makes_the_one_data_sampler_names():
    from rl_core.config import PosttrainConfig

    cfg = PosttrainConfig()
    assert type(build_sampler(cfg.data, 9, 3, 0)) is PromptSampler
    cfg.data.sampler, cfg.data.curriculum_floor, cfg.data.curriculum_ema = "curriculum", 0.2, 0.7
    made = build_sampler(cfg.data, 9, 3, 5)
    assert type(made) is CurriculumSampler and (made.floor, made.ema, made.seed, made.batch_size) == (0.2, 0.7, 5, 3)
