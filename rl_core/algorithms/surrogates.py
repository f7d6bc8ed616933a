"""Policy-gradient surrogates by name (`rl.grpo_surrogate`): a registered function each, not a branch.

A surrogate maps the current log-probs `ℓ [B, T]`, π_old's `ℓ^old [B, T]` (None when it reads none),
the advantages (`[B]` or `[B, T]`), the loss mask and the objective's settings to
`(per-token loss [B, T], stats)`. The GRPO family and OPD both look theirs up here; the formulas are
the pure functions of `rl_core.primitives.policy_gradient` (docs/objectives.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from rl_core.primitives.policy_gradient import clipped_policy_gradient_loss, legacy_policy_gradient_loss

SurrogateFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, Any],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Surrogate:
    """`fn(logp, old_logp, advantages, mask, settings) -> (per_token_loss, stats)`; `reads_old_logp`: it needs π_old
    (a ratio), so the objective keeps an `OldLogpCache` and the trainer scores π_old before the first update."""

    fn: SurrogateFn
    reads_old_logp: bool


def _clipped(logp, old_logp, advantages, mask, s):
    return clipped_policy_gradient_loss(
        logp, old_logp, advantages, mask, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high,
        lower_bound_ratio=s.lower_bound_ratio,
        importance_sampling_level=getattr(s, "importance_sampling_level", "token"))


def _legacy(logp, old_logp, advantages, mask, s):
    return legacy_policy_gradient_loss(logp, advantages, mask), {}


SURROGATES: Mapping[str, Surrogate] = MappingProxyType({
    "clipped": Surrogate(_clipped, reads_old_logp=True),
    "legacy_pg": Surrogate(_legacy, reads_old_logp=False),
})


def surrogate(name: str) -> Surrogate:
    try:
        return SURROGATES[name]
    except KeyError:
        raise ValueError(f"rl.grpo_surrogate={name!r}; expected one of {', '.join(SURROGATES)}") from None
