"""Policy-gradient surrogates by name (`rl.objective.surrogate`): a function registered with `@register_surrogate`.

A surrogate maps the current log-probs `ℓ [B, T]`, π_old's `ℓ^old [B, T]` (None when it reads none),
the advantages (`[B]` or `[B, T]`), the loss mask and the objective's settings to
`(per-token loss [B, T], stats)`. The GRPO family and OPD both look theirs up here; the formulas are
the pure functions of `rl_core.primitives.policy_gradient` (docs/objectives.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.primitives.objective import OBJECTIVE_WEIGHT_SUM, scalar_metrics
from rl_core.primitives.policy_gradient import (
    clipped_policy_gradient_loss,
    legacy_policy_gradient_loss,
    sampled_batch_diagnostics,
)
from rl_core.primitives.rollout_correction import rollout_correction_weights

SurrogateFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, Any],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Surrogate:
    """`fn(logp, old_logp, advantages, mask, settings) -> (per_token_loss, stats)`; `reads_old_logp`: it needs π_old
    (a ratio), so the objective keeps an `OldLogpCache` and the trainer scores π_old before the first update."""

    fn: SurrogateFn
    reads_old_logp: bool


SURROGATES: dict[str, Surrogate] = {}


def register_surrogate(name: str, *, reads_old_logp: bool):
    """Register `fn(logp, old_logp, advantages, mask, settings)` as the surrogate `name` (`rl.objective.surrogate`)."""
    def register(fn: SurrogateFn) -> SurrogateFn:
        if name in SURROGATES:
            raise ValueError(f"surrogate {name!r} is registered twice")
        SURROGATES[name] = Surrogate(fn, reads_old_logp)
        return fn
    return register


@register_surrogate("clipped", reads_old_logp=True)
def _clipped(logp, old_logp, advantages, mask, s):
    """PPO's clipped ratio surrogate with the dual clip (token or sequence ratios)."""
    return clipped_policy_gradient_loss(
        logp, old_logp, advantages, mask, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high,
        lower_bound_ratio=s.lower_bound_ratio,
        importance_sampling_level=getattr(s, "importance_sampling_level", "token"))


@register_surrogate("legacy_pg", reads_old_logp=False)
def _legacy(logp, old_logp, advantages, mask, s):
    """−A·ℓ: on-policy only, no ratio."""
    return legacy_policy_gradient_loss(logp, advantages, mask), {}


def corrected(per_token: torch.Tensor, stats: dict[str, torch.Tensor], old_logp: torch.Tensor,
              rollout_logp: torch.Tensor | None, mask: torch.Tensor, s: Any) -> tuple[torch.Tensor, dict]:
    """The per-token loss times the rollout-correction weights (`rl.objective.rollout_correction`, a ratio objective's
    knob; `rl_core.primitives.rollout_correction`), with their statistics; unchanged while it is off."""
    if s.rollout_correction == "off":
        return per_token, stats
    if rollout_logp is None:
        raise ValueError(f"batch.rollout_logp is missing: rl.objective.rollout_correction={s.rollout_correction} "
                         "weighs each token by pi_old / pi_rollout and needs the sampler's log-probs")
    weights, more = rollout_correction_weights(old_logp, rollout_logp, mask, mode=s.rollout_correction,
                                               level=s.rollout_correction_level, cap=s.rollout_correction_cap)
    return per_token * weights.to(per_token.dtype), {**stats, **more}


def surrogate(name: str) -> Surrogate:
    try:
        return SURROGATES[name]
    except KeyError:
        raise ValueError(f"surrogate {name!r} is not registered; one of {', '.join(SURROGATES)}") from None


# The metrics every surrogate-trained objective (GRPO family, OPD) publishes as train/<name>; each
# objective adds its own after `pg_loss` (GRPO `kl`, OPD `reverse_kl`). legacy_pg has no ratio, so the
# ratio/clip statistics are absent from its lines.
SURROGATE_METRICS = ("loss", "pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                     "ratio_mean", "ratio_min", "ratio_max", "approx_kl_old", "entropy", "advantage_mean",
                     "advantage_std", "rollout_logp_abs_diff", "rollout_logp_abs_diff_max")
# and with rl.objective.rollout_correction on (`corrected`)
CORRECTION_METRICS = ("rollout_is_weight_mean", "rollout_is_weight_max", "rollout_is_corrected_frac", "rollout_kl")


def metric_names(prefix: str, *own: str, corrected: bool = False) -> dict[str, str]:
    """An objective's algorithm-local metric name -> public suffix: `{prefix}_{name}` -> `name` (`corrected`: with
    the rollout correction's)."""
    names = (*SURROGATE_METRICS[:2], *own, *SURROGATE_METRICS[2:], *(CORRECTION_METRICS if corrected else ()))
    return {f"{prefix}_{n}": n for n in names}


def loss_and_metrics(prefix: str, numerator: torch.Tensor, weight: torch.Tensor, *, pg_numerator: torch.Tensor,
                     stats: dict[str, torch.Tensor], logp: torch.Tensor, rollout_logp: torch.Tensor | None,
                     entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     own: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`(numerator / weight, metrics)` of a chunk, with the metrics every surrogate objective logs.

    A chunk without loss tokens (weight 0) gives a zero loss that keeps the graph. Metrics are 0-d
    tensors on the device (`scalar_metrics`). Ratios of
    numerators (`pg_numerator`, each of `own`) are divided by the same weight, so they combine over
    chunks to the unsplit value; `metrics[OBJECTIVE_WEIGHT_SUM]` = weight.
    """
    denom = torch.where(weight > 0, weight, torch.ones_like(weight))  # no host sync: weight 0 has numerator 0
    loss = numerator / denom
    with torch.no_grad():
        values = {"loss": loss.detach(), "pg_loss": pg_numerator.detach() / denom,
                  **{k: v.detach() / denom for k, v in (own or {}).items()},
                  **sampled_batch_diagnostics(logp, rollout_logp, entropy, advantages, mask), **stats}
        metrics = scalar_metrics({f"{prefix}_{k}": v for k, v in values.items()})
    metrics[OBJECTIVE_WEIGHT_SUM] = weight.detach()
    return loss, metrics
