"""Rollout correction (rl.objective.rollout_correction): the weights π_old / π_rollout against their closed forms,
truncated and masked, per token and per sequence; the objective with equal log-probs is today's loss bit for bit,
and with unequal ones the hand-weighted loss; its knobs' rules, identity and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import GRPO
from rl_core.config import RLConfig
from rl_core.primitives.policy_gradient import clipped_policy_gradient_loss
from rl_core.primitives.rollout_correction import rollout_correction_weights
from tests.builders import grpo_batch, objective_problems, tiny_model

LN = math.log
# two rows of three positions; row 0 has loss tokens at 0..2, row 1 at 0..1 (position 2 is padding)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[LN(0.5), LN(0.9), LN(0.2)], [LN(0.3), LN(0.6), LN(0.7)]])
ROLLOUT = torch.tensor([[LN(0.25), LN(0.9), LN(0.5)], [LN(0.3), LN(0.1), LN(0.01)]])
# token ratios pi_old / pi_rollout: row 0: 2, 1, 0.4; row 1: 1, 6 (position 2 is not a loss token)


def test_token_level_truncation_and_masking_against_the_closed_form():
    w, stats = rollout_correction_weights(OLD, ROLLOUT, MASK, mode="tis", level="token", cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.4], [1.0, 3.0, 0.0]]), atol=1e-6)
    assert stats["rollout_is_corrected_frac"].item() == pytest.approx(1 / 5)  # the 6, truncated to 3
    assert stats["rollout_is_weight_mean"].item() == pytest.approx((2 + 1 + 0.4 + 1 + 3) / 5, rel=1e-6)
    assert stats["rollout_is_weight_max"].item() == pytest.approx(6.0, rel=1e-6)  # before truncation
    # KL(pi_rollout || pi_old) by k3: E[rho - 1 - log rho] over the 5 loss tokens
    k3 = sum(r - 1 - LN(r) for r in (2.0, 1.0, 0.4, 1.0, 6.0)) / 5
    assert stats["rollout_kl"].item() == pytest.approx(k3, rel=1e-5)

    w, stats = rollout_correction_weights(OLD, ROLLOUT, MASK, mode="mis", level="token", cap=2.2)
    # kept within [1/2.2, 2.2] = [0.45, 2.2]: 2, 1 and 1; the 0.4 and the 6 drop out
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6)
    assert stats["rollout_is_corrected_frac"].item() == pytest.approx(2 / 5)


def test_sequence_level_weighs_a_row_by_the_product_of_its_token_ratios():
    # row 0: 2 · 1 · 0.4 = 0.8; row 1: 1 · 6 = 6 (its padding position does not count)
    w, stats = rollout_correction_weights(OLD, ROLLOUT, MASK, mode="tis", level="sequence", cap=3.0)
    assert torch.allclose(w, torch.tensor([[0.8, 0.8, 0.8], [3.0, 3.0, 0.0]]), atol=1e-6)
    assert stats["rollout_is_corrected_frac"].item() == pytest.approx(2 / 5)  # row 1's two tokens
    assert stats["rollout_is_weight_max"].item() == pytest.approx(6.0, rel=1e-6)
    w, _ = rollout_correction_weights(OLD, ROLLOUT, MASK, mode="mis", level="sequence", cap=3.0)
    assert torch.allclose(w, torch.tensor([[0.8, 0.8, 0.8], [0.0, 0.0, 0.0]]), atol=1e-6)  # row 1 drops out
    w, _ = rollout_correction_weights(OLD, ROLLOUT, MASK, mode="mis", level="sequence", cap=1.2)
    assert torch.equal(w, torch.zeros_like(w))  # 0.8 < 1/1.2 too


def test_equal_log_probs_give_weights_of_exactly_one():
    w, stats = rollout_correction_weights(OLD, OLD.clone(), MASK, mode="tis", level="sequence", cap=2.0)
    assert torch.equal(w, MASK) and stats["rollout_kl"].item() == 0.0
    assert stats["rollout_is_corrected_frac"].item() == 0.0
    with pytest.raises(ValueError, match="cap 1.0 must be > 1"):
        rollout_correction_weights(OLD, OLD, MASK, mode="tis", level="token", cap=1.0)


def _objective(**correction):
    rl = RLConfig(objective=GRPO(**correction))
    return rl.objective.build(rl, ObjectiveContext(max_response_length=16))


def _loss_and_grads(objective, model, batch):
    model.zero_grad()
    objective.old_logp_cache.fill_on_policy(batch.sample_ids, batch.policy_version)
    loss, metrics = objective.fn(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_with_the_samplers_own_log_probs_the_loss_is_todays_bit_for_bit(mode, level):
    from rl_core.primitives.objective import LogprobScorer

    model = tiny_model()
    batch = grpo_batch([3, 5, 2, 4], [2, 3, 4, 2], seed=1)
    batch = batch.replace(rollout_logp=LogprobScorer(1.0)(model, batch))  # the sampler computed pi_old exactly
    off_loss, off_grads, _ = _loss_and_grads(_objective(), model, batch)
    loss, grads, metrics = _loss_and_grads(_objective(rollout_correction=mode, rollout_correction_level=level),
                                           model, batch)
    assert torch.equal(loss, off_loss) and all(torch.equal(a, b) for a, b in zip(grads, off_grads))
    assert metrics["grpo_rollout_is_weight_mean"].item() == 1.0 and metrics["grpo_rollout_kl"].item() == 0.0


def test_with_another_samplers_log_probs_the_loss_is_the_hand_weighted_one():
    from rl_core.primitives.objective import LogprobScorer

    model = tiny_model()
    batch = grpo_batch([3, 5, 2, 4], [2, 3, 4, 2], seed=1)
    old = LogprobScorer(1.0)(model, batch)
    g = torch.Generator().manual_seed(3)
    rollout = old + 0.8 * (torch.rand(old.shape, generator=g) - 0.5)  # a sampler that disagrees by up to 0.4 nats
    batch = batch.replace(rollout_logp=rollout)
    loss, _, metrics = _loss_and_grads(_objective(rollout_correction="tis", rollout_correction_cap=1.2), model, batch)
    mask = batch.loss_mask
    weights = torch.exp(old - rollout).clamp(max=1.2) * mask  # tis, token level, by hand
    per_token, _ = clipped_policy_gradient_loss(old, old, batch.advantages, mask, epsilon_low=0.2, epsilon_high=0.2,
                                                lower_bound_ratio=3.0)
    want = (per_token * weights * mask).sum() / mask.sum()  # token-mean, the reduction unchanged
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    on = mask > 0
    ratio = torch.exp(old - rollout)[on]
    assert metrics["grpo_rollout_is_corrected_frac"].item() == pytest.approx((ratio > 1.2).float().mean().item())
    assert metrics["grpo_rollout_is_weight_max"].item() == pytest.approx(ratio.max().item(), rel=1e-6)


def test_its_knobs_are_checked_and_enter_the_identity_only_when_on():
    assert any("rollout_correction_cap" in p for p in objective_problems(type="grpo", rollout_correction="tis",
                                                                         rollout_correction_cap=1.0))
    problems = objective_problems(type="grpo", rollout_correction_level="sequence")
    assert any("rollout_correction_level='sequence' is read only with rollout_correction=tis|mis" in p
               for p in problems), problems
    assert any("rollout_correction" in p for p in objective_problems(type="legacy_pg", rollout_correction="tis"))
    off, on = _objective(), _objective(rollout_correction="mis", rollout_correction_cap=3.0)
    assert not any(k.startswith("rollout_correction") for k in off.identity)
    assert on.identity["rollout_correction"] == "mis" and on.identity["rollout_correction_cap"] == 3.0
    assert "grpo_rollout_kl" in on.metric_adapter.names and "grpo_rollout_kl" not in off.metric_adapter.names
