"""Policy-gradient surrogates and their reductions (docs/objectives.md): pure tensor functions.

Shapes: `B` completions, `T` token positions. `logp`, `old_logp`, `mask` are `[B, T]` (mask float or
bool, 1 on loss tokens); `advantages` are `[B]` (one per completion) or `[B, T]` (per token).
Every function keeps the dtype of `logp` (tests run them in float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

LOG_RATIO_CLAMP = 20.0  # ρ = exp(clamp(ℓ − ℓ_old, −20, 20)): keeps exp finite for any log-prob gap
SEQUENCE_LOG_RATIO_MAX = 10.0  # GSPO: λ ≤ 10, from above only
LOSS_TYPES: list[str] = []  # filled by @loss_reduction below
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype)  # no copy when the dtype already matches


def _loss_tokens(mask: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Boolean `[B, T]`: the loss tokens (`M > 0`); a bool mask is used as it is."""
    return mask if mask.dtype == torch.bool else m > 0


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


def _sequence_mean_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, m: torch.Tensor,
                             on: torch.Tensor) -> torch.Tensor:
    """Detached `z_i = Σ_t M_{i,t} (ℓ_{i,t} − ℓ^old_{i,t}) / max(L_i, 1)`, `[B]`."""
    with torch.no_grad():
        diff = torch.where(on, logp - old_logp, 0.0)
        return diff.sum(-1) / m.sum(-1).clamp_min(1)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence log-ratio in stop-gradient token form (docs/objectives.md). `[B, T]` -> `[B, T]`.

        z_i     = (1 / L_i) Σ_t M_{i,t} (ℓ_{i,t} − ℓ^old_{i,t})          L_i = Σ_t M_{i,t} (≥ 1 used)
        λ_{i,t} = min(sg[z_i] + ℓ_{i,t} − sg[ℓ_{i,t}], 10)

    The value is `min(z_i, 10)` on every position of row i; the gradient at (i, t) reaches only
    `ℓ_{i,t}` (with coefficient 1 while z_i < 10, 0 once clamped).
    """
    m = _float_mask(mask, logp)
    z = _sequence_mean_log_ratio(logp, old_logp, m, _loss_tokens(mask, m))
    # ℓ − sg[ℓ] is exactly 0 in value, so the value is exactly z (no rounding through ℓ).
    token_path = logp - logp.detach()
    return torch.clamp(z.unsqueeze(-1) + token_path, max=SEQUENCE_LOG_RATIO_MAX)


class _SurrogateWithRatioGradient(torch.autograd.Function):
    """Value `op(x, y)`: the surrogate's last step on detached tensors, taken here so that the output is
    a tensor of its own. Gradient `∂/∂ℓ = (grad · coef_a) · coef_r`, in the order of the products
    autograd forms through `−A · ρ` and `exp` (so the result is bitwise the same)."""

    @staticmethod
    def forward(ctx, logp, op, x, y, coef_a, coef_r):
        ctx.save_for_backward(coef_a, coef_r)
        return op(x, y)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        coef_a, coef_r = ctx.saved_tensors
        return (grad * coef_a) * coef_r, None, None, None, None, None


def _clipped_surrogate_autograd(logp, old_logp, adv, m, *, epsilon_low, epsilon_high, lower_bound_ratio, sequence):
    """The surrogate as one autograd composition (the formula, op by op). `clipped_policy_gradient_loss`
    uses it when `old_logp` or the advantages need a gradient too; otherwise it computes the same value
    without autograd and attaches the gradient this composition would give (tests compare the two)."""
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
    return loss


def clip_settings_problem(lower_bound_ratio: float, importance_sampling_level: str = "token",
                          prefix: str = "") -> str | None:
    """The dual-clip rule, written once: a message naming `lower_bound_ratio`, or None when it holds.

    The dual-clip constant c is > 1 (a bound −cA below −A), or 0 to disable it; and there is no dual
    clip at `importance_sampling_level="sequence"` (GSPO). The primitive, the objective builders and
    preflight all ask this function; `prefix` ("rl.") names the keys as the config spells them.
    """
    c, level = f"{prefix}lower_bound_ratio", f"{prefix}importance_sampling_level"
    if lower_bound_ratio != 0 and lower_bound_ratio <= 1:
        return f"{c}={lower_bound_ratio}: the dual-clip constant must be > 1, or 0 to disable it"
    if importance_sampling_level == "sequence" and lower_bound_ratio != 0:
        return f"{c}={lower_bound_ratio}: no dual clip at {level}=sequence (GSPO, docs/objectives.md); set {c}=0"
    return None


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
    """Clipped surrogate per token (docs/objectives.md; GSPO at `importance_sampling_level="sequence"`).

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

    Value and gradient are bitwise those of the formula written op by op with autograd (at an exact
    tie of a max / min the gradient is split in half, as autograd splits it; a zero gradient may be
    −0.0 where autograd gives +0.0). The value is computed once without autograd, the statistics
    reuse it, and one backward node gives ∂/∂ℓ (first order only: no double backward). When
    `old_logp` or the advantages need a gradient too, the op-by-op composition is used instead.
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}; expected one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")
    if problem := clip_settings_problem(lower_bound_ratio, importance_sampling_level):
        raise ValueError(problem)
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp has shape {tuple(old_logp.shape)}; expected {tuple(logp.shape)} to match logp")
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(logp.shape)} to match logp")
    sequence = importance_sampling_level == "sequence"
    if sequence and advantages.dim() != 1:
        raise ValueError("advantages are per token (shape [B, T]) but importance_sampling_level='sequence' needs one "
                         "scalar advantage per completion ([B]); use importance_sampling_level='token'")
    adv = _broadcast_advantages(advantages, logp)
    m = _float_mask(mask, logp)
    on = _loss_tokens(mask, m)
    dtype, device = logp.dtype, logp.device
    dual_clip = lower_bound_ratio > 0
    lo, hi = 1.0 - epsilon_low, 1.0 + epsilon_high
    grad_enabled = torch.is_grad_enabled()
    # Fast path: the value below, computed without autograd, plus one backward node for ∂/∂ℓ. When
    # old_logp or the advantages need a gradient as well, the op-by-op composition builds the graph.
    fast = grad_enabled and logp.requires_grad and not (old_logp.requires_grad or advantages.requires_grad)

    with torch.no_grad():
        if sequence:
            # λ' = z + (ℓ − ℓ) and λ = min(λ', 10): the values `sequence_log_ratio` computes
            log_ratio = _sequence_mean_log_ratio(logp, old_logp, m, on).unsqueeze(-1) + (logp - logp)
            ratio_passes = log_ratio <= SEQUENCE_LOG_RATIO_MAX if fast else None  # the clamp's gradient mask
            log_ratio.clamp_(max=SEQUENCE_LOG_RATIO_MAX)
            delta = (logp - old_logp).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        else:
            log_ratio = logp - old_logp
            ratio_passes = log_ratio.abs() <= LOG_RATIO_CLAMP if fast else None  # the clamp's gradient mask
            delta = log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        del log_ratio
        unclipped = (adv * ratio).neg_()  # −A ρ (negation is exact)
        clipped = torch.clamp(ratio, lo, hi).mul_(adv).neg_()
        clip_active = clipped > unclipped
        below, above = ratio < lo, ratio > hi
        adv_neg = adv < 0

        # counts over the loss tokens, in one pass: #loss tokens, clip_frac, _low, _high, dual_clip_frac
        flags = [on, clip_active, adv_neg & below, (adv > 0) & above,
                 adv_neg & (ratio > lower_bound_ratio) if dual_clip else torch.zeros_like(on)]
        counts = (torch.stack(flags) & on).flatten(1).view(torch.uint8).sum(1, dtype=torch.int32)
        denom = m.sum().clamp_min(1)
        fractions = (counts[1:].to(dtype) / denom).unbind()  # integer counts: what a float sum of 0/1 gives
        buf = torch.where(on, ratio, 0.0)  # ρ on the loss tokens, 0 elsewhere; the buffer is reused below
        ratio_sum = buf.sum()
        inf = torch.full((), torch.inf, dtype=dtype, device=device)
        if buf.numel():
            ratio_max = torch.where(counts[0] > 0, buf.max(), -inf)  # ρ ≥ 0: the zeros do not win
            ratio_min = torch.where(on, ratio, inf, out=buf).min()
        else:
            ratio_min, ratio_max = inf, -inf
        torch.expm1(delta, out=buf).sub_(delta)  # k3 = exp(Δ) − Δ − 1
        del delta
        stats = {
            **dict(zip(("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac"), fractions)),
            "ratio_mean": ratio_sum / denom,
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "approx_kl_old": torch.where(on, buf, torch.zeros((), dtype=dtype, device=device), out=buf).sum() / denom,
        }
        del buf

        if fast:
            # ∂loss/∂ℓ = s · (−A) · ρ with s ∈ {0, ¼, ½, 1}, as autograd of the composition gives it:
            # maximum / minimum pass the gradient to the larger / smaller operand and half to each at a
            # tie; clamp passes it on its closed range only, so at a tie inside [1 − ε_low, 1 + ε_high]
            # both halves reach ρ. Per step, 2 = all, 1 = half, 0 = none (s = product / 4):
            #   max:  [clipped ≯ unclipped] + [unclipped > clipped or ρ in range]
            #   min:  [loss ≤ bound] + [loss < bound]          (bound = +inf where A ≥ 0: always 2)
            code = torch.add((~clip_active).view(torch.uint8),
                             ((unclipped > clipped) | ~(below | above)).view(torch.uint8))
            code.mul_(ratio_passes.view(torch.uint8))
            scale = -0.5
        if dual_clip or not fast:
            loss = torch.maximum(unclipped, clipped, out=unclipped)  # the two branches are not needed after
            del clipped
        if dual_clip:
            # −cA where A < 0 and +inf elsewhere, so the dual clip is one `minimum`: (c|A| + [A ≥ 0]) / [A < 0]
            # (c|A| equals −cA exactly when A < 0; x / 0 = +inf for x > 0).
            bound = (adv.abs().mul_(lower_bound_ratio).add_((~adv_neg).view(torch.uint8))
                     .div_(adv_neg.view(torch.uint8)))
            if fast:
                code.mul_(torch.add((loss <= bound).view(torch.uint8), (loss < bound).view(torch.uint8)))
                scale = -0.25
        if fast:
            coef_a = code.to(dtype).mul_(scale).mul_(adv)  # −A · s (scaling by a power of 2 is exact)
            coef_r = ratio.nan_to_num_(0.0)  # a NaN log-ratio is gated to zero gradient above

    if fast:
        x, y, op = (loss, bound, torch.minimum) if dual_clip else (unclipped, clipped, torch.maximum)
        return _SurrogateWithRatioGradient.apply(logp, op, x, y, coef_a, coef_r), stats
    if grad_enabled and (logp.requires_grad or old_logp.requires_grad or advantages.requires_grad):
        loss = _clipped_surrogate_autograd(logp, old_logp, adv, m, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                                           lower_bound_ratio=lower_bound_ratio, sequence=sequence)
    elif dual_clip:
        loss = torch.minimum(loss, bound)
    return loss, stats


def legacy_policy_gradient_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain REINFORCE-style surrogate (docs/objectives.md): `loss_{i,t} = −A_i ℓ_{i,t}`. `[B, T]` -> `[B, T]`.

    No ratio, no clip, no π_old; on-policy only. `mask` is accepted for a uniform signature and
    shape-checked; reduction applies it.
    """
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(logp.shape)} to match logp")
    return -_broadcast_advantages(advantages, logp) * logp


# loss_type -> `reduce(seq_sum [B], lengths [B], max_response_length) -> (numerator, weight)`, registered with
# `@loss_reduction(name)` next to its formula; `LOSS_TYPES` lists them in registration order.
REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]]] = {}


def loss_reduction(name: str):
    """Register a loss reduction under `loss_type=name` (the config validates against the registered names)."""
    def register(fn):
        if name in REDUCTIONS:
            raise ValueError(f"loss_type={name!r} is registered twice")
        REDUCTIONS[name] = fn
        LOSS_TYPES.append(name)
        return fn
    return register


def _sequences_with_tokens(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    has_tokens = lengths > 0
    return has_tokens, has_tokens.to(lengths.dtype).sum()


@loss_reduction("token-mean")
def _token_mean(seq_sum, lengths, max_response_length):
    """numerator Σ_i S_i, weight Σ_i L_i."""
    return seq_sum.sum(), lengths.sum()


@loss_reduction("seq-mean-token-mean")
def _seq_mean_token_mean(seq_sum, lengths, max_response_length):
    """numerator Σ_{i: L_i>0} S_i / L_i, weight B."""
    has_tokens, n_seq = _sequences_with_tokens(lengths)
    return torch.where(has_tokens, seq_sum / lengths.clamp_min(1), 0.0).sum(), n_seq


@loss_reduction("seq-mean-token-sum")
def _seq_mean_token_sum(seq_sum, lengths, max_response_length):
    """numerator Σ_i S_i, weight B."""
    return seq_sum.sum(), _sequences_with_tokens(lengths)[1]


@loss_reduction("seq-mean-token-sum-fixed")
def _seq_mean_token_sum_fixed(seq_sum, lengths, max_response_length):
    """numerator Σ_i S_i / max_len (the fixed divisor rollout.max_tokens), weight B."""
    n_seq = _sequences_with_tokens(lengths)[1]
    if max_response_length is None or max_response_length <= 0:
        raise ValueError("loss_type='seq-mean-token-sum-fixed' needs max_response_length (= rollout.max_tokens) > 0, "
                         f"got {max_response_length!r}")
    return seq_sum.sum() / max_response_length, n_seq


def reduce_policy_gradient_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and weight of one chunk (docs/objectives.md); the step loss is `Σ numerator / Σ weight`.

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
    reduce = REDUCTIONS.get(loss_type)
    if reduce is None:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {tuple(LOSS_TYPES)}")
    m = _float_mask(mask, per_token_loss)
    # a bool mask is 1 on every loss token: M · loss = loss there, exactly, so the product is skipped
    weighted = per_token_loss if mask.dtype == torch.bool else per_token_loss * m
    masked = torch.where(_loss_tokens(mask, m), weighted, 0.0)
    return reduce(masked.sum(-1), m.sum(-1), max_response_length)  # S_i, L_i


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
