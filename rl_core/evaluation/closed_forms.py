"""The loss formulas of docs/objectives.md as plain Python (the `math` module only, no torch), written once.

These are the independent, loop-by-loop references the test suite (tests/rl_core/test_primitives.py,
tests/rl_core/test_advantage.py) and the nightly regression (rl_core/evaluation/regression_checks.py) check the
tensor primitives of `rl_core.primitives` and `rl_core.annotators` against. They share no code with
those primitives, not even the clamp constants: a change to a primitive's contract has to be made
here as well, on purpose.

Scalars are Python floats; a batch is a list of rows (`logp[i][t]`, `mask[i][t]`, 1 on loss tokens),
one advantage per row (`advantages[i]`) or one per token (`advantages[i][t]`). Per-token results are
computed at every position, masked or not, as the primitives compute them; reductions skip the
positions whose mask is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Rows = Sequence[Sequence[float]]


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(min(x, hi), lo)


# ------------------------------------------------------------------------------ policy-gradient surrogates


def token_ratio(logp: float, old_logp: float) -> float:
    """ρ = exp(clamp(ℓ − ℓ_old, −20, 20))."""
    return math.exp(_clamp(logp - old_logp, -20.0, 20.0))


def sequence_log_ratio(logp: Sequence[float], old_logp: Sequence[float], mask: Sequence[float]) -> float:
    """GSPO's log-ratio of one row: min(z, 10), z = Σ_t M_t (ℓ_t − ℓ_old,t) / max(L, 1), L = Σ_t M_t
    (clamped from above only). The row's every position has ratio exp of this value."""
    z = sum(lp - old for lp, old, m in zip(logp, old_logp, mask) if m > 0) / max(sum(m for m in mask if m > 0), 1)
    return min(z, 10.0)


def clipped_surrogate(ratio: float, advantage: float, epsilon_low: float, epsilon_high: float,
                      lower_bound_ratio: float = 0.0) -> float:
    """max(−A ρ, −A clamp(ρ, 1 − ε_low, 1 + ε_high)), then, with a dual clip c > 0 and A < 0,
    min(that, −c A)."""
    loss = max(-advantage * ratio, -advantage * _clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    if lower_bound_ratio > 0 and advantage < 0:
        loss = min(loss, -lower_bound_ratio * advantage)
    return loss


def clipped_loss(logp: Rows, old_logp: Rows, advantages: Sequence[float] | Rows, mask: Rows, *, epsilon_low: float,
                 epsilon_high: float, lower_bound_ratio: float = 0.0,
                 importance_sampling_level: str = "token") -> list[list[float]]:
    """Per-token clipped surrogate of a batch, every position (`clipped_policy_gradient_loss`'s value).

    token:     ρ_{i,t} = exp(clamp(ℓ_{i,t} − ℓ_old,{i,t}, −20, 20))
    sequence:  ρ_{i,t} = exp(min(z_i, 10)) on the whole row i (GSPO; the primitive has no dual clip there)
    loss_{i,t} = `clipped_surrogate(ρ_{i,t}, A_{i(,t)}, ε_low, ε_high, c)`
    """
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}")
    out = []
    for row, old, m, adv in zip(logp, old_logp, mask, advantages, strict=True):
        seq_ratio = math.exp(sequence_log_ratio(row, old, m)) if importance_sampling_level == "sequence" else None
        out.append([clipped_surrogate(token_ratio(lp, lo) if seq_ratio is None else seq_ratio,
                                      adv[t] if isinstance(adv, Sequence) else adv,
                                      epsilon_low, epsilon_high, lower_bound_ratio)
                    for t, (lp, lo) in enumerate(zip(row, old, strict=True))])
    return out


def legacy_pg_loss(logp: Rows, advantages: Sequence[float] | Rows) -> list[list[float]]:
    """Plain REINFORCE surrogate per token: loss_{i,t} = −A_{i(,t)} ℓ_{i,t}."""
    return [[-(adv[t] if isinstance(adv, Sequence) else adv) * lp for t, lp in enumerate(row)]
            for row, adv in zip(logp, advantages, strict=True)]


# ------------------------------------------------------------------------------ reductions

LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-fixed")


def reduce_loss(per_token: Rows, mask: Rows, loss_type: str, max_response_length: int | None = None) -> float:
    """The step loss of a batch. S_i = Σ_t M_{i,t} loss_{i,t} and L_i = Σ_t M_{i,t} over the positions with
    M > 0 (nothing else is read, not even a NaN); B = #rows with L_i > 0 (at least one):

        token-mean                 Σ_i S_i / Σ_i L_i
        seq-mean-token-mean        (1/B) Σ_{i: L_i>0} S_i / L_i
        seq-mean-token-sum         (1/B) Σ_i S_i
        seq-mean-token-sum-fixed   (1/B) Σ_i S_i / max_response_length
    """
    rows = []
    for values, m in zip(per_token, mask, strict=True):
        on = [(v, w) for v, w in zip(values, m, strict=True) if w > 0]
        rows.append((sum(w * v for v, w in on), sum(w for _, w in on)))
    n_seq = sum(1 for _, n in rows if n > 0)
    if loss_type == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if loss_type == "seq-mean-token-mean":
        return sum(s / n for s, n in rows if n > 0) / n_seq
    if loss_type == "seq-mean-token-sum":
        return sum(s for s, _ in rows) / n_seq
    if loss_type == "seq-mean-token-sum-fixed":
        if not max_response_length or max_response_length <= 0:
            raise ValueError(f"seq-mean-token-sum-fixed needs max_response_length > 0, got {max_response_length!r}")
        return sum(s for s, _ in rows) / max_response_length / n_seq
    raise ValueError(f"loss_type={loss_type!r}; expected one of {LOSS_TYPES}")


# ------------------------------------------------------------------------------ KL to the reference


def kl_estimate(logp: float, ref_logp: float, estimator: str) -> float:
    """One token's estimate of KL(π ‖ π_ref):

        k1 = ℓ − ℓ_ref
        k2 = ½ (ℓ − ℓ_ref)²
        k3 = clamp(exp(Δ) − Δ − 1, −10, 10),   Δ = clamp(ℓ_ref − ℓ, −20, 20)
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        delta = _clamp(ref_logp - logp, -20.0, 20.0)
        return _clamp(math.exp(delta) - delta - 1.0, -10.0, 10.0)
    raise ValueError(f"kl estimator {estimator!r}; expected k1, k2 or k3")


def kl_penalty(logp: Rows, ref_logp: Rows, estimator: str) -> list[list[float]]:
    """`kl_estimate` at every position of a batch (`rl_core.primitives.kl.kl_penalty`'s value)."""
    return [[kl_estimate(lp, lr, estimator) for lp, lr in zip(row, ref, strict=True)]
            for row, ref in zip(logp, ref_logp, strict=True)]


# ------------------------------------------------------------------------------ group advantages


def group_advantages(rewards: Sequence[float], group_ids: Sequence[int], *, unbiased: bool = False,
                     eps: float = 1e-6) -> list[float]:
    """Each completion's advantage relative to its group (groups need not be contiguous; ≥ 2 members):

        μ_g = Σ r / n_g,   σ_g = sqrt(Σ (r − μ_g)² / (n_g − 1))   (unbiased standard deviation)
        GRPO    (unbiased=False):  A_i = (r_i − μ_g) / (σ_g + eps)
        Dr-GRPO (unbiased=True):   A_i = r_i − μ_g
        a group whose rewards are all equal: A_i = 0 exactly
    """
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        members.setdefault(g, []).append(float(r))
    stats = {}
    for g, group in members.items():
        if len(group) < 2:
            raise ValueError(f"group {g} has {len(group)} completion(s); group advantages need at least 2")
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        stats[g] = (mean, std, min(group) == max(group))
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        mean, std, constant = stats[g]
        out.append(0.0 if constant else r - mean if unbiased else (r - mean) / (std + eps))
    return out
