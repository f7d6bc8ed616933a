"""Per-token KL estimators for the KL anchor to the reference (docs/objectives.md): pure tensor functions."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_DELTA_CLAMP = 20.0
K3_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled tokens. `[B, T]`, `[B, T]` -> `[B, T]`.

        k1 = ℓ − ℓ^ref
        k2 = ½ (ℓ − ℓ^ref)²
        k3 = clamp(exp(Δ) − Δ − 1, −10, 10),   Δ = clamp(ℓ^ref − ℓ, −20, 20)

    Gradients flow through `logp` only (the reference is frozen). Reduce the result with the same
    `loss_type` as the policy term (`reduce_policy_gradient_loss`).
    """
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}; expected {tuple(logp.shape)} to match logp")
    ref = ref_logp.detach().to(logp.dtype)
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    if estimator == "k3":
        delta = torch.clamp(ref - logp, -KL_DELTA_CLAMP, KL_DELTA_CLAMP)
        return torch.clamp(torch.exp(delta) - delta - 1.0, -K3_CLAMP, K3_CLAMP)
    raise ValueError(f"kl estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
