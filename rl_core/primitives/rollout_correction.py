"""Rollout correction: importance weights between the trainer's π_old and the sampler's log-probs (docs/objectives.md).

The sampler (vLLM, or any engine) and the trainer compute the same policy with different kernels, precision and batch
shapes, and with `rl.async_steps` the sampler may hold older weights: its log-probs `ℓ^rollout` differ from the
trainer's `ℓ^old`. The clipped surrogate's ratio π/π_old assumes the batch was sampled from π_old; these weights
correct for the sampler being another distribution. With ρ = π_old / π_rollout:

    token level:     ρ_{i,t} = exp(clamp(ℓ^old_{i,t} − ℓ^rollout_{i,t}, −20, 20))
    sequence level:  ρ_{i,t} = exp(clamp(Σ_s M_{i,s} (ℓ^old_{i,s} − ℓ^rollout_{i,s}), −20, 20))   (every t of row i)
    tis (truncated): w = min(ρ, C)
    mis (masked):    w = ρ where 1/C ≤ ρ ≤ C, else 0 (the token, or the whole sequence, drops out of the loss)

Each per-token loss is multiplied by `w`, a constant (no gradient); the reduction is unchanged (a masked token still
counts in the denominator of its loss type). When the sampler's and π_old's log-probs are equal every ρ is exactly 1,
so the weights are exactly 1 and the loss is the uncorrected one, bit for bit.
"""

from __future__ import annotations

import math

import torch

MODES = ("tis", "mis")
LEVELS = ("token", "sequence")


def rollout_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, mode: str,
                               level: str, cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`(w [B, T], stats)`: the weights above (detached; 0 off the loss tokens) and detached 0-d statistics over the
    loss tokens: `rollout_is_weight_mean` (of w), `rollout_is_weight_max` (of ρ, before truncation or masking; −inf
    without loss tokens), `rollout_is_corrected_frac` (tokens whose ρ was truncated, tis, or masked, mis) and
    `rollout_kl` (the k3 estimate of KL(π_rollout ‖ π_old), E[ρ − 1 − log ρ] with token ratios)."""
    if mode not in MODES:
        raise ValueError(f"rollout correction mode {mode!r}; expected one of {MODES}")
    if level not in LEVELS:
        raise ValueError(f"rollout correction level {level!r}; expected one of {LEVELS}")
    if not cap > 1:
        raise ValueError(f"rollout correction cap {cap!r} must be > 1 (the weights are kept within [1/C, C])")
    if old_logp.shape != rollout_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape")
    with torch.no_grad():
        old = old_logp.detach()
        on = mask > 0
        m = on.to(old.dtype)
        delta = torch.where(on, old - rollout_logp.detach().to(old.dtype), torch.zeros_like(old))
        log_ratio = delta if level == "token" else delta.sum(-1, keepdim=True).expand_as(delta)
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
        if mode == "tis":
            corrected = ratio > cap
            weights = ratio.clamp(max=cap)
        else:
            corrected = (ratio < 1.0 / cap) | (ratio > cap)
            weights = torch.where(corrected, torch.zeros_like(ratio), ratio)
        weights = weights * m
        n_tok = m.sum().clamp_min(1)
        token_ratio = torch.exp(delta.clamp(-20.0, 20.0))
        stats = {
            "rollout_is_weight_mean": weights.sum() / n_tok,
            "rollout_is_weight_max": torch.where(on, ratio, torch.full_like(ratio, -math.inf)).max()
            if ratio.numel() else torch.tensor(-math.inf),
            "rollout_is_corrected_frac": (corrected & on).to(old.dtype).sum() / n_tok,
            "rollout_kl": ((token_ratio - 1 - delta.clamp(-20.0, 20.0)) * m).sum() / n_tok,
        }
    return weights, stats
