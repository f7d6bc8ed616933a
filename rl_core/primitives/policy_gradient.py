"""Policy-gradient surrogates and their reductions (docs/objectives.md): pure tensor functions.

Shapes: `B` completions, `T` token positions. `logp`, `old_logp`, `mask` are `[B, T]` (mask float or
bool, 1 on loss tokens); `advantages` are `[B]` (one per completion) or `[B, T]` (per token).
Every function keeps the dtype of `logp` (tests run them in float64).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # ρ = exp(clamp(ℓ − ℓ_old, −20, 20)): keeps exp finite for any log-prob gap
SEQUENCE_LOG_RATIO_MAX = 10.0  # GSPO: λ ≤ 10, from above only
LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-fixed")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype)


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`[B]` -> `[B, 1]` (broadcasts over tokens); `[B, T]` unchanged. Shape errors name the field."""
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [{like.shape[0]}] or "
                             f"{list(like.shape)} to match logp")
        return advantages.to(like.dtype).unsqueeze(-1)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [{like.shape[0]}] or "
                         f"{list(like.shape)} to match logp")
    return advantages.to(like.dtype)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum()
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / count.clamp_min(1)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence log-ratio in stop-gradient token form (SPEC §2.2). `[B, T]` -> `[B, T]`.

        z_i     = (1 / L_i) Σ_t M_{i,t} (ℓ_{i,t} − ℓ^old_{i,t})          L_i = Σ_t M_{i,t} (≥ 1 used)
        λ_{i,t} = min(sg[z_i] + ℓ_{i,t} − sg[ℓ_{i,t}], 10)

    The value is `min(z_i, 10)` on every position of row i; the gradient at (i, t) reaches only
    `ℓ_{i,t}` (with coefficient 1 while z_i < 10, 0 once clamped).
    """
    m = _float_mask(mask, logp)
    diff = torch.where(m > 0, logp - old_logp, torch.zeros_like(logp))
    lengths = m.sum(-1).clamp_min(1)
    z = (diff.sum(-1) / lengths).detach()
    # ℓ − sg[ℓ] is exactly 0 in value, so the value is exactly z (no rounding through ℓ).
    token_path = logp - logp.detach()
    return torch.clamp(z.unsqueeze(-1) + token_path, max=SEQUENCE_LOG_RATIO_MAX)


def clipped_policy_gradient_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    lower_bound_ratio: float = 0.0,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate per token (SPEC §2.1; §2.2 at `importance_sampling_level="sequence"`).

    token:     ρ_{i,t} = exp(clamp(ℓ_{i,t} − ℓ^old_{i,t}, −20, 20))
    sequence:  ρ_{i,t} = exp(λ_{i,t})                     (λ from `sequence_log_ratio`)
               loss_{i,t} = max(−A_i ρ, −A_i clamp(ρ, 1 − ε_low, 1 + ε_high))
    dual clip (token level only, c = lower_bound_ratio > 1; 0 disables):
               loss_{i,t} = min(loss_{i,t}, −c A_i)   where A_i < 0

    Args: logp, old_logp, mask `[B, T]`; advantages `[B]` or `[B, T]` (`[B]` only at sequence level).
    Returns `(per_token_loss [B, T], stats)`; the loss is not masked (reduce with
    `reduce_policy_gradient_loss`). `stats` are detached 0-d tensors over the masked tokens:
    `clip_frac` (clipped branch active: zero gradient), `clip_frac_low` (A < 0, ρ < 1 − ε_low),
    `clip_frac_high` (A > 0, ρ > 1 + ε_high), `dual_clip_frac` (A < 0, −cA binding), `ratio_mean`,
    `ratio_min`, `ratio_max` (±inf when there is no masked token), `approx_kl_old`
    (k3 estimate of KL(π_old ‖ π): E[exp(Δ) − Δ − 1], Δ = ℓ − ℓ^old).
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}; expected one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")
    if lower_bound_ratio != 0 and lower_bound_ratio <= 1:
        raise ValueError(f"lower_bound_ratio={lower_bound_ratio}: the dual-clip constant must be > 1, or 0 to disable")
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp has shape {tuple(old_logp.shape)}; expected {tuple(logp.shape)} to match logp")
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(logp.shape)} to match logp")
    sequence = importance_sampling_level == "sequence"
    if sequence and advantages.dim() != 1:
        raise ValueError("advantages are per token (shape [B, T]) but importance_sampling_level='sequence' needs one "
                         "scalar advantage per completion ([B]); use importance_sampling_level='token'")
    if sequence and lower_bound_ratio != 0:
        raise ValueError(f"lower_bound_ratio={lower_bound_ratio}: no dual clip at importance_sampling_level='sequence' "
                         "(SPEC §2.2); pass 0")
    adv = _broadcast_advantages(advantages, logp)
    m = _float_mask(mask, logp)

    if sequence:
        log_ratio = sequence_log_ratio(logp, old_logp, m)
    else:
        log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = torch.maximum(unclipped, clipped)
    if lower_bound_ratio > 0:
        dual = torch.minimum(loss, -lower_bound_ratio * adv)
        loss = torch.where(adv < 0, dual, loss)

    with torch.no_grad():
        r = ratio.detach()
        a = adv.expand_as(r)
        on = m > 0
        low = (a < 0) & (r < 1.0 - epsilon_low)
        high = (a > 0) & (r > 1.0 + epsilon_high)
        dual_active = (a < 0) & (r > lower_bound_ratio) if lower_bound_ratio > 0 else torch.zeros_like(on)
        delta = (logp - old_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        inf = torch.tensor(float("inf"), dtype=r.dtype)
        stats = {
            "clip_frac": _masked_mean((clipped.detach() > unclipped.detach()).to(r.dtype), m),
            "clip_frac_low": _masked_mean(low.to(r.dtype), m),
            "clip_frac_high": _masked_mean(high.to(r.dtype), m),
            "dual_clip_frac": _masked_mean(dual_active.to(r.dtype), m),
            "ratio_mean": _masked_mean(r, m),
            "ratio_min": torch.where(on, r, inf).min() if r.numel() else inf,
            "ratio_max": torch.where(on, r, -inf).max() if r.numel() else -inf,
            "approx_kl_old": _masked_mean(torch.expm1(delta) - delta, m),
        }
    return loss, stats


def legacy_policy_gradient_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain REINFORCE-style surrogate (SPEC §2.3): `loss_{i,t} = −A_i ℓ_{i,t}`. `[B, T]` -> `[B, T]`.

    No ratio, no clip, no π_old; on-policy only. `mask` is accepted for a uniform signature and
    shape-checked; reduction applies it.
    """
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(logp.shape)} to match logp")
    return -_broadcast_advantages(advantages, logp) * logp


def reduce_policy_gradient_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and weight of one chunk (SPEC §3); the step loss is `Σ numerator / Σ weight`.

    `S_i = Σ_t M_{i,t} loss_{i,t}`, `L_i = Σ_t M_{i,t}`, `B` = #completions with `L_i > 0`:

    | loss_type                  | numerator             | weight    |
    | token-mean                 | Σ_i S_i               | Σ_i L_i   |
    | seq-mean-token-mean        | Σ_{i: L_i>0} S_i/L_i  | B         |
    | seq-mean-token-sum         | Σ_i S_i               | B         |
    | seq-mean-token-sum-fixed   | Σ_i S_i / max_len     | B         |

    Summing numerators and weights over every micro-batch and rank, then dividing once, gives the
    unsplit value exactly (up to float rounding). Masked-out positions never contribute, even if
    they hold inf/NaN. Args `[B, T]`; returns two 0-d tensors in the loss dtype.
    """
    if mask.shape != per_token_loss.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(per_token_loss.shape)}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {LOSS_TYPES}")
    m = _float_mask(mask, per_token_loss)
    masked = torch.where(m > 0, per_token_loss * m, torch.zeros_like(per_token_loss))
    seq_sum = masked.sum(-1)  # S_i
    lengths = m.sum(-1)  # L_i
    if loss_type == "token-mean":
        return seq_sum.sum(), lengths.sum()
    has_tokens = lengths > 0
    n_seq = has_tokens.to(per_token_loss.dtype).sum()
    if loss_type == "seq-mean-token-mean":
        per_seq = torch.where(has_tokens, seq_sum / lengths.clamp_min(1), torch.zeros_like(seq_sum))
        return per_seq.sum(), n_seq
    if loss_type == "seq-mean-token-sum":
        return seq_sum.sum(), n_seq
    if max_response_length is None or max_response_length <= 0:
        raise ValueError("loss_type='seq-mean-token-sum-fixed' needs max_response_length (= rollout.max_tokens) > 0, "
                         f"got {max_response_length!r}")
    return seq_sum.sum() / max_response_length, n_seq


def sampled_batch_diagnostics(logp: torch.Tensor, rollout_logp: torch.Tensor, entropy: torch.Tensor,
                              advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Diagnostics every on-policy objective reports, as detached scalar tensors (call under no_grad).

    `entropy`: mean token entropy over loss tokens; `advantage_mean/std`: over completions with loss
    tokens, one advantage per completion (a `[B, T]` advantage is averaged over its loss tokens);
    `rollout_logp_abs_diff` / `_max`: mean / max `|ℓ − ℓ_rollout|` over loss tokens (sampler vs
    trainer log-probs: stale rollout weights show here).
    """
    logp = logp.detach()
    on = mask > 0
    n_tok = mask.sum().clamp_min(1)
    row_adv = advantages if advantages.dim() == 1 else (advantages * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    row_adv = row_adv.detach()[on.any(-1)].to(torch.float64)
    diff = torch.where(on, (logp - rollout_logp.to(logp.dtype)).abs(), torch.zeros_like(logp))
    return {
        "entropy": (entropy * mask).sum() / n_tok,
        "advantage_mean": row_adv.mean() if row_adv.numel() else torch.zeros(()),
        "advantage_std": row_adv.std(unbiased=False) if row_adv.numel() else torch.zeros(()),
        "rollout_logp_abs_diff": diff.sum() / n_tok,
        "rollout_logp_abs_diff_max": diff.max() if diff.numel() else torch.zeros(()),
    }
