"""The loss formulas (docs/objectives.md) against the plain-Python closed forms of `rl_core.evaluation.closed_forms`
(scalar by scalar, in float64); gradient closed forms specific to a test are written in the test."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.evaluation import closed_forms
from rl_core.primitives.kl import kl_penalty
from rl_core.primitives.policy_gradient import (
    clipped_policy_gradient_loss,
    legacy_policy_gradient_loss,
    reduce_policy_gradient_loss,
    sequence_log_ratio,
)

LOSS_TYPES = closed_forms.LOSS_TYPES
LENGTHS = [1, 3, 7, 16]
MAX_LEN = 20
DT = torch.float64


def ragged(lengths=LENGTHS, prompt=2, seed=0, spread=0.3):
    """A ragged batch: row i has lengths[i] loss tokens after a prompt of `prompt` tokens."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), prompt + max(lengths) + 1
    mask = torch.zeros(b, t, dtype=DT)
    for i, n in enumerate(lengths):
        mask[i, prompt:prompt + n] = 1
    logp = -torch.rand(b, t, generator=g, dtype=DT) * 3
    old = logp + (torch.rand(b, t, generator=g, dtype=DT) - 0.5) * 2 * spread
    adv = torch.randn(b, generator=g, dtype=DT)
    return logp, old, adv, mask


def scalar_reduce(per_token, mask, loss_type):
    """The closed-form step loss (`rl_core.evaluation.closed_forms.reduce_loss`) at this file's MAX_LEN."""
    return closed_forms.reduce_loss(per_token, mask, loss_type, max_response_length=MAX_LEN)


def step_value(per_token, mask, loss_type):
    num, w = reduce_policy_gradient_loss(per_token, mask, loss_type, max_response_length=MAX_LEN)
    return num / w


# ------------------------------------------------------------------------------ clipped, token level


@pytest.mark.parametrize("c", [0.0, 3.0])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_clipped_token_matches_closed_form(loss_type, c):
    logp, old, adv, mask = ragged(spread=1.5)  # wide spread: every branch occurs
    adv[1] = -abs(adv[1]) - 0.5
    old[1, 2:5] = logp[1, 2:5] - torch.tensor([-2.0, 0.5, 1.5], dtype=DT)  # ρ = e^2 > c: dual clip binds
    per_token, stats = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                                                    lower_bound_ratio=c)
    expected = closed_forms.clipped_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), epsilon_low=0.2,
                                         epsilon_high=0.28, lower_bound_ratio=c)
    assert torch.allclose(per_token, torch.tensor(expected, dtype=DT), atol=1e-12)
    got = step_value(per_token, mask, loss_type)
    assert got.item() == pytest.approx(scalar_reduce(expected, mask.tolist(), loss_type), abs=1e-12)
    # dual-clip fraction counts tokens with A<0 and ρ>c, only when the dual clip is on
    ratio = torch.exp(logp - old)
    n_dual = int(((ratio > 3.0) & (adv.unsqueeze(-1) < 0) & (mask > 0)).sum())
    assert n_dual >= 1
    assert stats["dual_clip_frac"].item() == pytest.approx(n_dual / mask.sum().item() if c else 0.0)


def _one_token(l, lo, a, el=0.2, eh=0.28, c=3.0):
    logp = torch.tensor([[l]], dtype=DT, requires_grad=True)
    old = torch.tensor([[lo]], dtype=DT)
    loss, stats = clipped_policy_gradient_loss(logp, old, torch.tensor([a], dtype=DT), torch.ones(1, 1, dtype=DT),
                                               epsilon_low=el, epsilon_high=eh, lower_bound_ratio=c)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), {k: v.item() for k, v in stats.items()}


@pytest.mark.parametrize(
    "log_rho, a, c, branch",
    [
        (math.log(1.5), 1.0, 3.0, "high"),  # A>0, ρ > 1+ε_high: clipped at 1+ε_high, zero gradient
        (math.log(1.1), 1.0, 3.0, "none"),  # A>0 inside the range
        (math.log(0.5), 1.0, 3.0, "none"),  # A>0 below 1−ε_low: the unclipped branch is the max
        (math.log(0.5), -1.0, 3.0, "low"),  # A<0, ρ < 1−ε_low: clipped at 1−ε_low, zero gradient
        (math.log(2.0), -1.0, 3.0, "none"),  # A<0 between 1+ε_high and c: unclipped
        (math.log(5.0), -1.0, 3.0, "dual"),  # A<0, ρ > c: loss −cA, zero gradient
        (math.log(5.0), -1.0, 0.0, "none"),  # dual clip off: unclipped −Aρ
    ],
)
def test_clip_branches_and_their_gradients(log_rho, a, c, branch):
    l, lo = -1.0, -1.0 - log_rho
    rho = math.exp(log_rho)
    loss, grad, stats = _one_token(l, lo, a, c=c)
    if branch == "high":
        assert loss == pytest.approx(-a * 1.28) and grad == 0.0
    elif branch == "low":
        assert loss == pytest.approx(-a * 0.8) and grad == 0.0
    elif branch == "dual":
        assert loss == pytest.approx(-c * a) and grad == 0.0
    else:
        assert loss == pytest.approx(-a * rho) and grad == pytest.approx(-a * rho)  # d(−Aρ)/dℓ = −Aρ
    assert stats["clip_frac_high"] == (1.0 if branch == "high" else 0.0)
    assert stats["clip_frac_low"] == (1.0 if branch == "low" else 0.0)
    assert stats["clip_frac"] == (1.0 if branch in ("high", "low") else 0.0)
    assert stats["dual_clip_frac"] == (1.0 if branch == "dual" else 0.0)


def test_log_ratio_clamped_at_20():
    loss, grad, stats = _one_token(0.0, -50.0, -1.0, c=0.0)  # ℓ − ℓ_old = 50 -> clamped to 20
    assert loss == pytest.approx(math.exp(20.0)) and grad == 0.0  # clamp kills the gradient
    assert stats["ratio_max"] == pytest.approx(math.exp(20.0))


def test_masked_positions_never_leak():
    logp, old, adv, mask = ragged()
    old = old.clone()
    old[mask == 0] = -1e30  # would give ρ = e^20 off the mask
    per_token, stats = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    per_token = per_token.clone()
    per_token[mask == 0] = float("nan")
    for lt in LOSS_TYPES:
        assert torch.isfinite(step_value(per_token, mask, lt))
    assert stats["ratio_max"].item() < 10


def test_bool_mask_equals_float_mask():
    logp, old, adv, mask = ragged()
    a, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    b, _ = clipped_policy_gradient_loss(logp, old, adv, mask.bool(), epsilon_low=0.2, epsilon_high=0.2)
    for lt in LOSS_TYPES:
        assert torch.equal(step_value(a, mask, lt), step_value(b, mask.bool(), lt))


def test_per_token_advantages_at_token_level():
    logp, old, _, mask = ragged()
    adv = torch.randn(logp.shape, dtype=DT)
    per_token, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    expected = closed_forms.clipped_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), epsilon_low=0.2,
                                         epsilon_high=0.2)
    assert torch.allclose(per_token, torch.tensor(expected, dtype=DT), atol=1e-12)


def test_invalid_dual_clip_constant_refused():
    logp, old, adv, mask = ragged()
    with pytest.raises(ValueError, match="lower_bound_ratio"):
        clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2, lower_bound_ratio=0.5)


# ------------------------------------------------------------------------------ GSPO (sequence level)


def test_sequence_log_ratio_value_and_per_token_gradient():
    logp, old, _adv, mask = ragged()
    logp = logp.clone().requires_grad_(True)
    lam = sequence_log_ratio(logp, old, mask)
    for i in range(len(LENGTHS)):
        z = closed_forms.sequence_log_ratio(logp[i].tolist(), old[i].tolist(), mask[i].tolist())
        assert torch.allclose(lam[i], torch.full_like(lam[i], z), rtol=0, atol=1e-14)
    # d/dℓ_{j,u} of Σ_{i,t} w_{i,t} λ_{i,t} = w_{j,u}: each position's gradient reaches only its own ℓ
    w = torch.randn(logp.shape, dtype=DT)
    (lam * w).sum().backward()
    assert torch.equal(logp.grad, w)


def test_sequence_log_ratio_clamped_from_above_at_10_only():
    logp = torch.zeros(2, 3, dtype=DT, requires_grad=True)
    old = torch.tensor([[-12.0, -12.0, -12.0], [15.0, 15.0, 15.0]], dtype=DT)  # z = 12 and z = −15
    mask = torch.ones(2, 3, dtype=DT)
    lam = sequence_log_ratio(logp, old, mask)
    assert torch.equal(lam[0], torch.full((3,), 10.0, dtype=DT))  # clamped
    assert torch.equal(lam[1], torch.full((3,), -15.0, dtype=DT))  # no lower clamp
    lam.sum().backward()
    assert torch.equal(logp.grad, torch.tensor([[0.0] * 3, [1.0] * 3], dtype=DT))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_loss_value_and_gradient_against_formula(loss_type):
    el, eh = 3e-4, 4e-4
    logp, _, _, mask = ragged()
    # per-row sequence log-ratios chosen to hit each branch: inside, above 1+ε_high, below 1−ε_low
    zs = [1e-4, 5e-3, -5e-3, 2e-4]
    old = logp - torch.tensor(zs, dtype=DT).unsqueeze(-1)
    adv = torch.tensor([1.0, 1.0, -1.0, -0.5], dtype=DT)
    logp = logp.clone().requires_grad_(True)
    per_token, stats = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=el, epsilon_high=eh,
                                                    importance_sampling_level="sequence")
    loss = step_value(per_token, mask, loss_type)
    loss.backward()
    # closed form: s_i = exp(z_i) on every token; clipped rows (1: A>0 above, 2: A<0 below) have zero gradient
    expected_tok, expected_grad = [], torch.zeros(logp.shape, dtype=DT)
    _, weight = reduce_policy_gradient_loss(per_token.detach(), mask, loss_type, max_response_length=MAX_LEN)
    for i, n in enumerate(LENGTHS):
        s = math.exp(zs[i])
        a = adv[i].item()
        tok = closed_forms.clipped_surrogate(s, a, el, eh)
        expected_tok.append([tok if mask[i, t] else 0.0 for t in range(logp.shape[1])])
        clipped = (a > 0 and s > 1 + eh) or (a < 0 and s < 1 - el)
        coeff = {"token-mean": 1.0, "seq-mean-token-mean": 1.0 / n, "seq-mean-token-sum": 1.0,
                 "seq-mean-token-sum-fixed": 1.0 / MAX_LEN}[loss_type]
        for t in range(logp.shape[1]):
            if mask[i, t] and not clipped:
                expected_grad[i, t] = -a * s * coeff / weight.item()  # d(−A s)/dℓ_{i,t} = −A s, own token only
    assert loss.item() == pytest.approx(scalar_reduce(expected_tok, mask.tolist(), loss_type), rel=1e-9)
    assert torch.allclose(logp.grad, expected_grad, atol=1e-12)
    assert stats["clip_frac_high"].item() == pytest.approx(LENGTHS[1] / sum(LENGTHS))
    assert stats["clip_frac_low"].item() == pytest.approx(LENGTHS[2] / sum(LENGTHS))


def test_gspo_ratio_value_is_exp_of_clamped_z():
    logp = torch.zeros(1, 4, dtype=DT)
    old = torch.full((1, 4), -11.0, dtype=DT)
    _, stats = clipped_policy_gradient_loss(logp, old, torch.tensor([1.0], dtype=DT), torch.ones(1, 4, dtype=DT),
                                            epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="sequence")
    assert stats["ratio_max"].item() == pytest.approx(math.exp(10.0))


def test_sequence_level_refuses_per_token_advantages_and_dual_clip():
    logp, old, _, mask = ragged()
    with pytest.raises(ValueError, match="per token"):
        clipped_policy_gradient_loss(logp, old, torch.randn(logp.shape, dtype=DT), mask, epsilon_low=0.2,
                                     epsilon_high=0.2, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="dual clip"):
        clipped_policy_gradient_loss(logp, old, torch.randn(4, dtype=DT), mask, epsilon_low=0.2, epsilon_high=0.2,
                                     lower_bound_ratio=3.0, importance_sampling_level="sequence")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_equals_sequence_on_policy(loss_type):
    base, _, adv, mask = ragged()
    results = []
    for level, c in (("token", 3.0), ("sequence", 0.0)):
        logp = base.clone().requires_grad_(True)
        per_token, _ = clipped_policy_gradient_loss(logp, logp.detach(), adv, mask, epsilon_low=0.2,
                                                    epsilon_high=0.28, lower_bound_ratio=c,
                                                    importance_sampling_level=level)
        loss = step_value(per_token, mask, loss_type)
        loss.backward()
        results.append((loss.detach(), logp.grad.clone()))
    (v_tok, g_tok), (v_seq, g_seq) = results
    assert torch.allclose(v_tok, v_seq, atol=1e-14) and torch.allclose(g_tok, g_seq, atol=1e-14)
    # and both equal the on-policy closed form: value Σ −A M / w, gradient −A M / w (ρ = 1)
    expected = [[-adv[i].item() for _ in range(mask.shape[1])] for i in range(mask.shape[0])]
    assert v_tok.item() == pytest.approx(scalar_reduce(expected, mask.tolist(), loss_type), rel=1e-12)
    assert g_tok.abs().sum() > 0


# ------------------------------------------------------------------------------ fast path = autograd composition


def _exact_log(target, dtype):
    """A float x with exp(x) == target exactly in `dtype` (searched around log(target)), or None."""
    x = torch.tensor(math.log(target), dtype=dtype)
    want = torch.tensor(target, dtype=dtype)
    for _ in range(64):
        got = torch.exp(x)
        if got == want:
            return x
        x = torch.nextafter(x, torch.tensor(math.inf if got < want else -math.inf, dtype=dtype))
    return None


def near_bounds(dtype, b=32, t=64, seed=0):
    """Log-ratios at and a few ulps around ρ = 0.8, 1.28, 3 (ε_low = 0.2, ε_high = 0.28, c = 3) and
    advantages of mixed scale and sign, some 0, per token: exact and rounding ties between the max / min
    operands occur. NaN and ±inf log-probs sit off the mask (the last 6 positions)."""
    g = torch.Generator().manual_seed(seed)
    bases = [x for x in (_exact_log(v, dtype) for v in (0.8, 1.28, 3.0)) if x is not None]
    bases = torch.stack(bases + [torch.tensor(0.1, dtype=dtype)])
    d = bases[torch.randint(0, len(bases), (b, t), generator=g)]
    for _ in range(3):
        up = torch.rand(b, t, generator=g) < 0.5
        step = torch.nextafter(d, torch.where(up, math.inf, -math.inf).to(dtype))
        d = torch.where(torch.rand(b, t, generator=g) < 0.4, step, d)
    logp = -torch.rand(b, t, generator=g, dtype=dtype)
    old = logp - d
    scales = torch.tensor([1.0, 1e-3, 3.0, 7.0], dtype=dtype)
    adv = torch.randn(b, t, generator=g, dtype=dtype) * scales[torch.randint(0, 4, (b, t), generator=g)]
    adv[:, :3] = 0.0
    mask = torch.ones(b, t, dtype=dtype)
    mask[:, -6:] = 0
    old[:, -1], old[:, -2], old[:, -4] = math.nan, -math.inf, 1e30
    logp[:, -3], old[:, -3] = -math.inf, -math.inf  # Δ = NaN
    return logp, old, adv, mask


def _surrogate_step(logp, old, adv, mask, loss_type="token-mean", composed=False, **kw):
    """Value, ∂/∂ℓ and stats; `composed=True` makes the advantages need a gradient, which selects the
    op-by-op autograd composition of the formula."""
    logp = logp.clone().requires_grad_(True)
    adv = adv.clone().requires_grad_(composed)
    per_token, stats = clipped_policy_gradient_loss(logp, old, adv, mask, **kw)
    num, weight = reduce_policy_gradient_loss(per_token, mask, loss_type, max_response_length=MAX_LEN)
    (num / weight).backward()
    return per_token.detach(), logp.grad, stats


def _assert_identical(fast, composed):
    (v1, g1, s1), (v2, g2, s2) = fast, composed
    torch.testing.assert_close(v1, v2, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(g1, g2) and bool(torch.isfinite(g1).all())
    for k in s2:
        torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.parametrize("dtype", [torch.float32, DT])
@pytest.mark.parametrize("c", [0.0, 3.0])
@pytest.mark.parametrize("per_token_adv", [True, False])
def test_fast_path_equals_autograd_composition_bitwise(dtype, c, per_token_adv):
    """Value, gradient and stats are bitwise those of autograd through the formula op by op, at ties of
    max / min too (where autograd splits the gradient in half), with NaN / inf off the mask."""
    logp, old, adv, mask = near_bounds(dtype)
    if not per_token_adv:
        adv = adv[:, 5]
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.28, "lower_bound_ratio": c}
    fast = _surrogate_step(logp, old, adv, mask, **kw)
    _assert_identical(fast, _surrogate_step(logp, old, adv, mask, composed=True, **kw))
    assert torch.equal(fast[1][mask == 0], torch.zeros_like(fast[1][mask == 0]))
    if dtype == torch.float32 and per_token_adv:  # the data does hit both kinds of tie
        with torch.no_grad():
            r = torch.exp((logp - old).clamp(-20, 20))
            unclipped, clipped = -adv * r, -adv * r.clamp(0.8, 1.28)
            on = (mask > 0) & (adv != 0)
            assert bool(((unclipped == clipped) & (r != r.clamp(0.8, 1.28)) & on).any())
            assert bool(((torch.maximum(unclipped, clipped) == -3.0 * adv) & (adv < 0) & on).any())


@pytest.mark.parametrize("bool_mask", [False, True])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fast_path_equals_autograd_composition_gspo(loss_type, bool_mask):
    logp, old, _, mask = ragged(lengths=[1, 3, 7, 16, 0, 5], spread=0.01)
    old[0] = logp[0] - 11.0  # z > 10: λ clamped, zero gradient
    old[5, :4] = math.nan  # off the mask (prompt positions)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25, 2.0, 0.0], dtype=DT)
    if bool_mask:
        mask = mask.bool()
    kw = {"epsilon_low": 3e-3, "epsilon_high": 4e-3, "importance_sampling_level": "sequence"}
    fast = _surrogate_step(logp, old, adv, mask, loss_type, **kw)
    _assert_identical(fast, _surrogate_step(logp, old, adv, mask, loss_type, composed=True, **kw))
    assert bool((fast[1][0] == 0).all()) and bool((fast[1][1:4] != 0).any())


def test_stats_against_their_definitions():
    logp, old, adv, mask = ragged(spread=1.5)
    old[1, 2:5] = logp[1, 2:5] - torch.tensor([-2.0, 0.5, 1.5], dtype=DT)
    adv[1] = -abs(adv[1]) - 0.5
    old[mask == 0] = math.nan  # never reaches a statistic
    _, stats = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                                            lower_bound_ratio=3.0)
    with torch.no_grad():
        values, no_grad_stats = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2,
                                                             epsilon_high=0.28, lower_bound_ratio=3.0)
    on = mask > 0
    delta = (logp - old)[on]
    a = adv.unsqueeze(-1).expand_as(logp)[on]
    r = torch.exp(delta)
    expected = {
        "clip_frac": (a * r.clamp(0.8, 1.28) < a * r).double().mean(),
        "clip_frac_low": ((a < 0) & (r < 0.8)).double().mean(),
        "clip_frac_high": ((a > 0) & (r > 1.28)).double().mean(),
        "dual_clip_frac": ((a < 0) & (r > 3.0)).double().mean(),
        "ratio_mean": r.mean(), "ratio_min": r.min(), "ratio_max": r.max(),
        "approx_kl_old": (torch.exp(delta) - delta - 1).mean(),
    }
    assert expected["dual_clip_frac"] > 0 and expected["clip_frac"] > 0
    for k, v in expected.items():
        assert stats[k].item() == pytest.approx(v.item(), rel=1e-12, abs=1e-15), k
        assert torch.equal(stats[k], no_grad_stats[k]), k
    assert torch.isfinite(values[on]).all()
    _, none = clipped_policy_gradient_loss(logp, old, adv, torch.zeros_like(mask), epsilon_low=0.2, epsilon_high=0.2)
    assert none["ratio_min"].item() == math.inf and none["ratio_max"].item() == -math.inf
    assert all(none[k].item() == 0.0 for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac",
                                               "ratio_mean", "approx_kl_old"))


def test_old_logp_gradient_through_the_composition():
    logp, old, adv, mask = ragged(spread=1.5)
    old = old.clone().requires_grad_(True)
    logp = logp.clone().requires_grad_(True)
    per_token, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                                                lower_bound_ratio=3.0)
    num, weight = reduce_policy_gradient_loss(per_token, mask, "token-mean")
    (num / weight).backward()
    assert torch.equal(old.grad, -logp.grad) and logp.grad.abs().sum() > 0


# ------------------------------------------------------------------------------ legacy PG and reductions


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_legacy_pg_value_and_gradient(loss_type):
    base, _, adv, mask = ragged()
    logp = base.clone().requires_grad_(True)
    loss = step_value(legacy_policy_gradient_loss(logp, adv, mask), mask, loss_type)
    loss.backward()
    expected = closed_forms.legacy_pg_loss(base.tolist(), adv.tolist())
    assert loss.item() == pytest.approx(scalar_reduce(expected, mask.tolist(), loss_type), rel=1e-12)
    b, total = len(LENGTHS), sum(LENGTHS)
    for i, n in enumerate(LENGTHS):
        coeff = {"token-mean": 1 / total, "seq-mean-token-mean": 1 / (n * b), "seq-mean-token-sum": 1 / b,
                 "seq-mean-token-sum-fixed": 1 / (MAX_LEN * b)}[loss_type]
        assert torch.allclose(logp.grad[i], -adv[i] * mask[i] * coeff, atol=1e-14)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reductions_numerator_and_weight(loss_type):
    lengths = LENGTHS + [0]  # an empty completion: not counted in B
    per_token = torch.randn(len(lengths), 18, dtype=DT)
    mask = torch.zeros_like(per_token)
    for i, n in enumerate(lengths):
        mask[i, 1:1 + n] = 1
    num, w = reduce_policy_gradient_loss(per_token, mask, loss_type, max_response_length=MAX_LEN)
    assert (num / w).item() == pytest.approx(scalar_reduce(per_token.tolist(), mask.tolist(), loss_type), rel=1e-12)
    assert w.item() == (sum(lengths) if loss_type == "token-mean" else len(LENGTHS))
    # sums over any split give the unsplit value
    parts = [reduce_policy_gradient_loss(per_token[s], mask[s], loss_type, max_response_length=MAX_LEN)
             for s in (slice(0, 1), slice(1, 3), slice(3, 5))]
    assert (sum(p[0] for p in parts) / sum(p[1] for p in parts)).item() == pytest.approx((num / w).item(), rel=1e-12)


def test_fixed_divisor_needs_max_response_length():
    with pytest.raises(ValueError, match="max_response_length"):
        reduce_policy_gradient_loss(torch.zeros(1, 2), torch.ones(1, 2), "seq-mean-token-sum-fixed")
    with pytest.raises(ValueError, match="loss_type"):
        reduce_policy_gradient_loss(torch.zeros(1, 2), torch.ones(1, 2), "seq-mean")


# ------------------------------------------------------------------------------ KL estimators


def test_kl_estimators_against_closed_form():
    logp = torch.tensor([[-1.0, -2.0, -0.1, -30.0, -0.5]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.1, -0.5, -25.0]], dtype=DT)  # includes |Δ| > 20 and k3 > 10
    for est in ("k1", "k2", "k3"):
        kl = kl_penalty(logp, ref, est)
        expected = closed_forms.kl_penalty(logp.tolist(), ref.tolist(), est)[0]
        grads = []  # the gradient's closed form: d/dℓ of each estimator, 0 where a clamp binds
        for l, r in zip(logp[0].tolist(), ref[0].tolist()):
            if est == "k1":
                grads.append(1.0)
            elif est == "k2":
                grads.append(l - r)
            else:
                d = max(-20.0, min(20.0, r - l))
                clamped = math.exp(d) - d - 1 > 10 or abs(r - l) > 20
                grads.append(0.0 if clamped else 1.0 - math.exp(d))  # d/dℓ (e^Δ − Δ − 1), Δ = ℓ_ref − ℓ
        assert kl[0].tolist() == pytest.approx(expected, rel=1e-12)
        (g,) = torch.autograd.grad(kl.sum(), logp)
        assert g[0].tolist() == pytest.approx(grads, rel=1e-12, abs=1e-12)
    assert kl_penalty(logp, ref, "k3")[0, 4].item() == 10.0
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k4")


def test_k3_is_zero_and_nonnegative():
    logp = torch.randn(3, 5, dtype=DT)
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))
    assert bool((kl_penalty(logp, logp + torch.randn(3, 5, dtype=DT), "k3") >= 0).all())
