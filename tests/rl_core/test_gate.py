"""The pandera gate: annotations table and tensor batch checks, each corruption named."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_core.annotate import annotate
from rl_core.batch.gate import (
    BatchValidationError,
    annotations_schema,
    validate_annotations,
    validate_batch_tensors,
)
from rl_core.config import RLConfig
from rl_core.rollout.base import build_completions

EOS, PAD = 2, 0


def make_step(rewards=(1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0), n=4, version=3, rl=None):
    prompts = [[1, 5, 6], [1, 7]]
    # ragged responses; the last of each group is truncated (no EOS)
    responses = [[9, EOS], [9, 9, 9, EOS], [8, EOS], [8, 8, 8, 8],
                 [EOS], [9, 8, EOS], [9, EOS], [7, 7, 7, 7]]
    logps = [[-0.5] * len(r) for r in responses]
    comp = build_completions(prompts, responses, logps, n=n, eos_token_id=EOS, pad_token_id=PAD, max_tokens=4,
                             policy_version=version)
    return annotate(comp, list(rewards), [10, 42], rl=rl or RLConfig(), first_sample_id=100)


def test_annotate_builds_the_table_and_batch_by_hand():
    a = make_step()
    t = a.table
    assert list(t["sample_id"]) == list(range(100, 108))
    assert list(t["prompt_id"]) == [10] * 4 + [42] * 4
    assert list(t["group_size"]) == [4] * 8
    assert list(t["response_len"]) == [2, 4, 2, 4, 1, 3, 2, 4]
    assert list(t["truncated"]) == [False, False, False, True, False, False, False, True]
    # group 0 rewards [1,0,1,1]: (r - 0.75) / (0.5 + eps)  (worked check)
    expected = (np.array([1, 0, 1, 1]) - 0.75) / (0.5 + 1e-6)
    np.testing.assert_allclose(t["advantage"][:4], expected, rtol=1e-6)
    assert a.stats["rollout/truncation_rate"] == pytest.approx(2 / 8)
    assert a.stats["rollout/reward_mean"] == pytest.approx(4 / 8)
    assert torch.equal(a.batch.loss_mask.sum(1).long(), torch.tensor([2, 4, 2, 4, 1, 3, 2, 4]))
    validate_annotations(t, max_tokens=4)
    validate_batch_tensors(a.batch, t)


def test_mask_truncated_leaves_cut_completions_out_of_the_loss_and_in_their_groups_advantages():
    """rl.objective.mask_truncated: the two rows cut at max_tokens (3 and 7) get an all-zero loss mask and rollout
    log-probs; every advantage is the one computed with their rewards (the groups are unchanged)."""
    from rl_core.algorithms.grpo import GRPO

    kept, cut = make_step(), make_step(rl=RLConfig(objective=GRPO(mask_truncated=True)))
    assert torch.equal(cut.batch.loss_mask.sum(1).long(), torch.tensor([2, 4, 2, 0, 1, 3, 2, 0]))
    assert torch.equal(cut.batch.advantages, kept.batch.advantages)
    assert not cut.batch.rollout_logp[[3, 7]].any() and torch.equal(cut.batch.rollout_logp[[0, 1, 2, 4, 5, 6]],
                                                                     kept.batch.rollout_logp[[0, 1, 2, 4, 5, 6]])
    assert cut.stats["rollout/truncation_rate"] == pytest.approx(2 / 8)
    assert cut.stats["rollout/masked_prefix_frac"] == kept.stats["rollout/masked_prefix_frac"] == 0.0
    assert list(cut.table["masked_len"]) == [0, 0, 0, 4, 0, 0, 0, 4]
    validate_annotations(cut.table, max_tokens=4)
    validate_batch_tensors(cut.batch, cut.table)
    # only annotate may leave a row out whole: the same mask against the unmasked table is refused
    assert "loss_tokens>=1" in refused(validate_batch_tensors, cut.batch, kept.table)


def test_a_shared_prefix_masked_by_annotate_passes_the_gate():
    """rl.objective.shared_prefix_min_tokens: rows 0 and 1 share the prefix [9] with different rewards; its token
    leaves their loss, the table records it (masked_len) and the gate counts the rest."""
    shared = make_step(rl=RLConfig(shared_prefix_min_tokens=1))
    assert list(shared.table["masked_len"][:2]) == [1, 1]
    assert torch.equal(shared.batch.loss_mask.sum(1).long(),
                       torch.tensor(list(shared.table["response_len"] - shared.table["masked_len"])))
    validate_annotations(shared.table, max_tokens=4)
    validate_batch_tensors(shared.batch, shared.table)


def test_zero_advantage_groups_are_counted():
    a = make_step(rewards=(1, 1, 1, 1, 0, 1, 0, 0))
    assert a.stats["rollout/zero_adv_group_frac"] == pytest.approx(0.5)
    assert (a.table["advantage"][:4] == 0).all()


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(BatchValidationError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_nan_reward_is_refused():
    a = make_step()
    table = a.table.copy()
    table.loc[2, "reward"] = math.nan
    msg = refused(validate_annotations, table, max_tokens=4)
    assert "reward" in msg and "rows [2]" in msg


def test_missing_group_member_is_refused():
    a = make_step()
    table = a.table.drop(index=5)
    msg = refused(validate_annotations, table, max_tokens=4)
    assert "complete_groups" in msg


def test_over_long_response_is_refused_naming_the_bound():
    a = make_step()
    msg = refused(validate_annotations, a.table, max_tokens=3)
    assert "response_len" in msg and "rollout.max_tokens" in msg


def test_mixed_policy_versions_are_refused():
    a = make_step()
    table = a.table.copy()
    table.loc[6, "policy_version"] = 2
    msg = refused(validate_annotations, table, max_tokens=4)
    assert "one_policy_version" in msg and "rows [6]" in msg


def test_group_advantages_must_sum_to_zero_for_group_estimators():
    a = make_step()
    table = a.table.copy()
    table.loc[0, "advantage"] += 0.5
    assert "group_advantages_sum_to_zero" in refused(validate_annotations, table, max_tokens=4)
    validate_annotations(table, max_tokens=4, group_relative=False)  # e.g. OPD's per-token signal


def test_missing_or_extra_column_is_refused():
    a = make_step()
    assert "truncated" in refused(validate_annotations, a.table.drop(columns="truncated"), max_tokens=4)
    extra = a.table.assign(debug=1)
    assert "debug" in refused(validate_annotations, extra, max_tokens=4)


def test_several_failures_are_reported_together():
    a = make_step()
    table = a.table.copy()
    table.loc[1, "reward"] = math.inf
    table.loc[7, "policy_version"] = 9
    msg = refused(validate_annotations, table, max_tokens=4)
    assert "finite_reward" in msg and "one_policy_version" in msg


def test_tensor_batch_nan_logp_is_refused():
    a = make_step()
    logp = a.batch.rollout_logp.clone()
    logp[3, -1] = math.nan
    msg = refused(validate_batch_tensors, a.batch.replace(rollout_logp=logp), a.table)
    assert "logp_finite" in msg


def test_tensor_batch_lengths_must_match_the_table():
    a = make_step()
    mask = a.batch.loss_mask.clone()
    mask[0] = 0
    mask[0, 2:4] = 1  # two loss tokens (the count is what the table records)
    validate_batch_tensors(a.batch.replace(loss_mask=mask), a.table)
    mask[0, 1:4] = 1  # three loss tokens where the table says 2
    batch = a.batch.replace(loss_mask=mask * a.batch.attention_mask.float())
    assert "loss_tokens==response_len-masked_len" in refused(validate_batch_tensors, batch, a.table)


def test_tensor_batch_positive_logp_and_missing_advantages():
    a = make_step()
    logp = a.batch.rollout_logp.clone()
    logp[1][a.batch.loss_mask[1] > 0] = 0.3
    assert "logp_max" in refused(validate_batch_tensors, a.batch.replace(rollout_logp=logp), a.table)
    assert "advantages" in refused(validate_batch_tensors, a.batch.replace(advantages=None), a.table)


def test_annotate_passes_a_nan_reward_to_the_gate():
    a = make_step(rewards=(1.0, math.nan, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0))
    assert a.table["advantage"][:4].isna().all() and a.table["advantage"][4:].notna().all()
    msg = refused(validate_annotations, a.table, max_tokens=4)
    assert "finite_reward" in msg or "reward" in msg


def test_the_policy_version_window_bounds_the_staleness_naming_the_bound():
    """rl.async_steps: a batch may come from the trainer's version or up to async_steps before it, no other."""
    table = make_step(version=3).table
    validate_annotations(table, max_tokens=4, versions=(3, 3))  # on-policy
    validate_annotations(table, max_tokens=4, versions=(3, 4))  # one version stale, async_steps=1
    for window in ((4, 4), (4, 5), (1, 2)):
        with pytest.raises(BatchValidationError, match=rf"policy_version in \[{window[0]}, {window[1]}\]") as err:
            validate_annotations(table, max_tokens=4, versions=window)
        assert "8 failing" in str(err.value)  # every row, named
    # each window is a copy: the schema cached for the run's bounds keeps its own checks, so the next step's
    # window is the only one that applies
    validate_annotations(table, max_tokens=4, versions=(3, 3))
    assert [c.name for c in annotations_schema(4).columns["policy_version"].checks] == ["greater_than_or_equal_to"]


def test_a_step_whose_every_completion_is_cut_passes_the_gate_and_skips_its_update(in_workdir):
    """rl.objective.mask_truncated through the run's own pieces (the policy worker's trainer, the engine, annotate,
    the gate): the random-init model samples to rollout.max_tokens, so every completion is cut and left out of the
    loss; the gate takes the batch and the trainer skips its update, weights unchanged. Without the knob the same
    batch is trained on (an optimizer step applied)."""
    from infra.cluster.roles import RolloutRole
    from infra.workers.engines import build_engine
    from infra.workers.policy import build_trainer
    from rl_core.config import load_config
    from rl_core.rewards import reward_inputs, score
    from rl_core.rewards.configured import reward_functions
    from tests.conftest import recipe

    def step(*knob):
        cfg = load_config(recipe("arithmetic"), ["model.name_or_path=artifacts/tiny-model/init", "rl.objective.type=grpo",
                                                 "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=6",
                                                 *knob])
        role = RolloutRole.build(cfg)
        trainer, tokenizer = build_trainer(cfg, None, torch.device("cpu"))
        engine = build_engine(cfg, torch.device("cpu"), model=trainer.model, tokenizer=tokenizer)
        rows = role.sampler.next_batch()
        completions = engine.generate(role.prompts(rows), cfg.rollout.n, role.sampling(1))
        assert set(completions.finish_reason) == {"length"}
        examples = [role.train[rows[i]] for i in completions.prompt_index.tolist()]
        rewards, _ = score(reward_functions(cfg.data), reward_inputs(examples, completions.decode_responses(tokenizer)))
        annotated = annotate(completions, rewards, rows, rl=cfg.rl, first_sample_id=0)
        validate_annotations(annotated.table, max_tokens=6)
        validate_batch_tensors(annotated.batch, annotated.table, annotated.sampled)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        metrics = trainer.train_step(annotated.batch)
        return metrics, all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), trainer.step

    assert step("rl.objective.mask_truncated=true") == ({"train/skipped_updates": 1.0}, True, 0)
    metrics, _, steps = step()  # every reward 0 here: an applied update of zero advantages
    assert "train/skipped_updates" not in metrics and "train/loss" in metrics and steps == 1
