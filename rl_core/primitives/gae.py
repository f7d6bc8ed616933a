"""Generalized advantage estimation (GAE) and the clipped value loss of PPO with a critic, on the batch's token
layout: `[B, T]` tensors whose `mask` is 1 on the tokens the policy sampled (its actions) and 0 on the prompt, the
padding and an agent episode's environment tokens (holes between turns).

Rewards per token (`token_rewards`): row i's sequence reward on its last action token; where an environment scores
each turn, each turn's reward on that turn's last action token (a turn: a run of action tokens); and, with a KL
penalty in the reward, −β·kl_t on every action token (`kl`: a per-token estimate against the reference policy).

GAE runs from the last position backwards, carrying V' (the value of the next action token) and A' (its advantage),
both 0 past a row's end, or V' = the value of the row's last action token when the row was cut by a limit
(`bootstrap`: its return goes on past the cut instead of ending there):

    δ_t = r_t + γ V' − V_t,    A_t = δ_t + γ λ A'                on an action token, which then sets V' = V_t, A' = A_t
    V', A' unchanged                                            on a hole (and A_t there is the A' it carries)

so the environment's tokens are not steps of the MDP: one turn's last action is followed by the next turn's first.
Returns R_t = A_t + V_t are the critic's target; the policy's advantages are A whitened over the batch's action
tokens, (A − mean) / sqrt(var + 1e-8) with the unbiased masked variance. With `bootstrap` all False these are
verl's `compute_gae_advantage_return` and `masked_whiten`, position for position (holes included).

The value loss is PPO's clipped one: with V_old the critic's values when the batch was collected and c the clip,
0.5 · max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²) per action token (verl's `compute_value_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, *, turn_rewards: Sequence[Sequence[float]] | None = None,
                  kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """`[B, T]` rewards per token (module docstring) from `scores [B]`; a row without an action token gets none.
    `turn_rewards[i]`: row i's reward for each of its turns, in order (as many as it has turns)."""
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores {list(scores.shape)} must be one per row of the mask {list(mask.shape)}")
    on = mask > 0
    out = torch.zeros(mask.shape, dtype=torch.float32)
    positions = torch.arange(mask.shape[1]).expand_as(on)
    last = torch.where(on, positions, -1).max(dim=1).values
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] += scores.float()[rows]
    if turn_rewards is not None:
        for i, rewards in enumerate(turn_rewards):
            ends = [t for t in range(mask.shape[1]) if on[i, t] and (t + 1 == mask.shape[1] or not on[i, t + 1])]
            if len(rewards) != len(ends):
                raise ValueError(f"row {i} has {len(ends)} turns but {len(rewards)} turn rewards")
            for t, reward in zip(ends, rewards):
                out[i, t] += float(reward)
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.float() * on
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
        bootstrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(advantages, returns)`, both `[B, T]`, before whitening (module docstring). `bootstrap [B]` bool: the rows cut
    by a limit, whose last action token's value stands for what follows."""
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(f"rewards {list(rewards.shape)}, values {list(values.shape)} and mask {list(mask.shape)} "
                         "must have one shape [B, T]")
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    if bootstrap is not None:
        positions = torch.arange(mask.shape[1]).expand_as(mask)
        last = torch.where(mask > 0, positions, -1).max(dim=1).values
        cut = bootstrap.bool() & (last >= 0)
        next_value = torch.where(cut, values.gather(1, last.clamp_min(0)[:, None])[:, 0], next_value)
    carried = torch.zeros_like(values[:, 0])
    reversed_advantages = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * carried
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        carried = advantage * m[:, t] + (1 - m[:, t]) * carried
        reversed_advantages.append(carried)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages, advantages + values


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x − mean) / sqrt(var + eps)` over the positions where `mask` is 1 (unbiased variance): every position is
    shifted and scaled, the masked ones with the statistics of the others."""
    m = mask.to(x.dtype)
    count = m.sum()
    if count < 2:
        raise ValueError(f"whitening needs at least two masked positions, got {int(count)}")
    mean = (x * m).sum() / count
    var = (((x - mean) ** 2) * m).sum() / count * (count / (count - 1))
    return (x - mean) * torch.rsqrt(var + eps)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss [B, T], clipped_fraction)`: PPO's clipped value loss per action token, 0 elsewhere (module docstring),
    and the share of action tokens whose clipped term is the larger."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    on = mask > 0
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss) * on
    fraction = (clipped_loss > unclipped_loss)[on].float().mean() if bool(on.any()) else values.new_zeros(())
    return loss, fraction
