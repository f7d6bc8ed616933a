"""Annotators: statistics over whole groups, made at the reward/annotate stage before dispatch."""

from __future__ import annotations

from rl_core.annotators.advantage import group_advantages, zero_advantage_group_fraction
from rl_core.annotators.shared_prefix import shared_prefix_lengths, shared_prefix_loss_mask


def annotate_group_advantages(batch, rl) -> tuple[object, dict[str, float]]:
    """Apply the advantage annotators of `rl.objective` (its group-advantage knobs) to a complete-group Trajectory.

    Returns `(batch with advantages [B] (and the shared-prefix loss mask), stats)`; stats hold
    `zero_adv_group_frac` and `shared_prefix_masked_frac` (fraction of loss tokens masked).
    """
    knobs = rl.objective
    adv = group_advantages(batch.rewards, batch.group_ids, unbiased=knobs.unbiased_advantage, eps=knobs.advantage_eps)
    mask = shared_prefix_loss_mask(batch.input_ids, batch.loss_mask, batch.rewards, batch.group_ids,
                                   knobs.shared_prefix_min_tokens)
    before = float(batch.loss_mask.sum())
    stats = {
        "zero_adv_group_frac": zero_advantage_group_fraction(batch.rewards, batch.group_ids),
        "shared_prefix_masked_frac": (before - float(mask.sum())) / before if before else 0.0,
    }
    return batch.replace(advantages=adv, loss_mask=mask), stats


__all__ = [
    "annotate_group_advantages", "group_advantages", "shared_prefix_lengths", "shared_prefix_loss_mask",
    "zero_advantage_group_fraction",
]
