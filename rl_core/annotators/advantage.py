"""Group-relative advantages (docs/objectives.md), computed on complete groups before dispatch.

The objective never derives group statistics from its local batch: dispatch may split a group
across ranks and micro-batches, so the advantage is an annotation made here, on the whole batch.
"""

from __future__ import annotations

import torch


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique group ids [G], inverse index [N], group sizes [G])."""
    unique, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return unique, inverse, counts


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    unbiased: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of each completion relative to its group. `[N]`, `[N]` -> `[N]` (dtype of rewards).

        μ_g = mean of the group's rewards,  σ_g = sqrt(Σ (r − μ_g)² / (n_g − 1))   (Bessel, ddof = 1)
        unbiased=False (GRPO):     A_i = (r_i − μ_g) / (σ_g + eps)
        unbiased=True  (Dr-GRPO):  A_i = r_i − μ_g

    A group whose rewards are all equal gets exactly 0 for every member. Every group must have at
    least 2 members (ValueError naming the group otherwise). Computed in float64.
    Worked check: [1, 0] -> [0.7071.., -0.7071..]; [1, 0, 1, 1] -> [0.5, -1.5, 0.5, 0.5].
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {list(rewards.shape)} and group_ids {list(group_ids.shape)} must both be [N]")
    if rewards.numel() == 0:
        return rewards.clone()
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:8]
        raise ValueError(f"rewards are not finite at rows {bad}")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    unique, inverse, counts = _group_index(group_ids)
    small = counts < 2
    if bool(small.any()):
        raise ValueError(f"group_ids {unique[small].tolist()[:8]} have fewer than 2 completions; group-relative "
                         "advantages need rollout.n >= 2 and complete groups")
    r = rewards.to(torch.float64)
    n = counts.to(torch.float64)
    mean = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, r) / n
    centred = r - mean[inverse]
    r_min = torch.full((len(unique),), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    r_max = torch.full((len(unique),), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    constant = (r_min == r_max)[inverse]
    if unbiased:
        adv = centred
    else:
        var = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, centred**2) / (n - 1)
        adv = centred / (var.sqrt()[inverse] + eps)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.dtype.is_floating_point else torch.float32)


def zero_advantage_group_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (they carry zero advantage): `zero_adv_group_frac`."""
    if rewards.numel() == 0:
        return 0.0
    unique, inverse, _ = _group_index(group_ids)
    r = rewards.to(torch.float64)
    r_min = torch.full((len(unique),), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    r_max = torch.full((len(unique),), float("-inf"), dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    return float((r_min == r_max).double().mean())
