"""On-policy distillation (rl_core.algorithms.opd): advantage and direct modes against closed forms,
the reverse-KL estimator on exactly enumerable categorical toys, micro-batch / rank invariance through
LLMTrainer, identity and preflight rules. Tiny random Llama on CPU."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.opd import (
    OPD_METRIC_NAMES,
    build_objective,
    discounted_future_sum,
    opd_annotate,
    opd_token_advantages,
    reverse_kl_coefficients,
    reverse_kl_surrogate,
    teacher_logprobs,
)
from rl_core.batch.gate import BatchValidationError, validate_teacher_logp
from rl_core.batch.trajectory import Trajectory
from rl_core.config import OptimizerConfig, PosttrainConfig, RLConfig, config_from_dict
from rl_core.preflight.rules import preflight
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.policy_gradient import clipped_policy_gradient_loss
from rl_core.training.trainer import LLMTrainer
from tests.builders import objective_problems, rollout_layout, tiny_model
from tests.ranks import run_ranks

MAX_LEN = 24
RESP = [1, 3, 7, 6, 5, 2, 8, 4]
PROMPT = [4, 2, 3, 4, 1, 4, 2, 3]
NO_CLIP = OptimizerConfig(lr=1e-3, max_grad_norm=1e9)
TOL = 1e-6


def make_batch(student, teacher, resp=RESP, prompt=PROMPT, seed=0):
    """A sampled-looking batch: rollout_logp = the student's own log-probs (on-policy), teacher_logp scored."""
    g = torch.Generator().manual_seed(seed)
    ids, att, loss = rollout_layout(prompt, resp, g)
    b, t = ids.shape
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    rewards[::2] = 1.0 - rewards[1::2]  # no constant group
    batch = Trajectory(ids, att, loss, torch.zeros(b, t), rewards, torch.arange(b) // 2, torch.arange(b) + 100, 0)
    with torch.no_grad():
        own = sequence_token_logprobs(student, ids, att, temperature=1.0) * loss
    batch = batch.replace(rollout_logp=own)
    return batch.replace(teacher_logp=teacher_logprobs(teacher, batch, temperature=1.0))


def grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def opd_rl(mode="advantage", **kw):
    return RLConfig(distillation_mode=mode, **kw)


def opd_trainer(model, rl, hook=None):
    return LLMTrainer(copy.deepcopy(model), build_objective(rl, ObjectiveContext(MAX_LEN)), NO_CLIP, dp_reducer=hook)


def hand_discounted(values, mask, gamma):
    """Σ_{t' ≥ t} γ^{t'−t} M_{t'} v_{t'} on loss positions, written as the double loop."""
    out = torch.zeros_like(values)
    b, t = values.shape
    for i in range(b):
        for s in range(t):
            if mask[i, s] == 0:
                continue
            out[i, s] = sum(gamma ** (u - s) * values[i, u] for u in range(s, t) if mask[i, u] != 0)
    return out


# ------------------------------------------------------------------------------ advantage mode


def test_teacher_equals_student_gives_zero_advantage():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(4, 7, generator=g) > 0.3).double()
    for gamma in (0.0, 0.5, 1.0):
        adv = opd_token_advantages(logp * mask, logp * mask, mask, kl_coef=2.0, discount=gamma)
        assert torch.equal(adv, torch.zeros_like(adv))
    # end to end: the teacher is a copy of the student -> zero advantages, zero gradient, zero reverse KL
    student = tiny_model(0)
    batch = make_batch(student, copy.deepcopy(student))
    rl = opd_rl(opd_discount=0.7)
    annotated, stats = opd_annotate(batch, rl)
    assert torch.equal(annotated.advantages, torch.zeros_like(batch.loss_mask))
    assert stats["opd/teacher_reverse_kl"] == 0.0
    trainer = opd_trainer(student, rl)
    metrics = trainer.train_step(annotated, 4)
    assert metrics["train/grad_norm"] == 0.0 and metrics["train/loss"] == 0.0
    assert metrics["train/reverse_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 1.0])
def test_discounting_matches_hand_computed_sum_on_ragged_mask(gamma):
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(3, 8, generator=g, dtype=torch.float64) * 2
    teacher = -torch.rand(3, 8, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0],     # ragged lengths, right padding
                         [0, 1, 1, 0, 1, 1, 1, 1],     # a masked hole inside the response
                         [0, 0, 0, 0, 0, 0, 0, 0]],    # no loss token at all
                        dtype=torch.float64)
    teacher[0, 7] = float("-inf")  # masked positions may hold anything
    kl_coef = 0.3
    adv = opd_token_advantages(rollout, teacher, mask, kl_coef=kl_coef, discount=gamma)
    expected = hand_discounted(torch.where(mask > 0, -kl_coef * (rollout - teacher), 0.0), mask, gamma)
    assert torch.allclose(adv, expected, atol=1e-12, rtol=0)
    assert torch.isfinite(adv).all() and adv.dtype == torch.float64 and not adv.requires_grad
    # spot check one entry by hand: row 1, position 1, γ over the hole at position 3
    r = -kl_coef * (rollout[1] - teacher[1])
    by_hand = r[1] + gamma * r[2] + gamma ** 3 * r[4] + gamma ** 4 * r[5] + gamma ** 5 * r[6] + gamma ** 6 * r[7]
    assert float(adv[1, 1]) == pytest.approx(float(by_hand), abs=1e-12)
    assert torch.equal(discounted_future_sum(rollout, mask, 0.0), torch.where(mask > 0, rollout, 0.0))


def test_annotate_adds_weighted_group_advantage_on_loss_tokens():
    student, teacher = tiny_model(0), tiny_model(1)
    batch = make_batch(student, teacher)
    rl = opd_rl(opd_kl_coef=0.5, opd_discount=0.5, opd_task_reward_weight=2.0)
    annotated, stats = opd_annotate(batch, rl)
    token = opd_token_advantages(batch.rollout_logp, batch.teacher_logp, batch.loss_mask, kl_coef=0.5, discount=0.5)
    # groups of two with rewards {0, 1}: group advantages ±1/√2
    group = (batch.rewards - 0.5) / (0.5 ** 0.5 + 1e-6)
    expected = token + 2.0 * group.unsqueeze(-1) * batch.loss_mask
    assert annotated.advantages.shape == batch.loss_mask.shape
    assert torch.allclose(annotated.advantages, expected, atol=1e-6)
    assert torch.equal(annotated.advantages * (1 - batch.loss_mask), torch.zeros_like(batch.loss_mask))
    assert stats["opd/teacher_reverse_kl"] > 0  # student and teacher differ
    # direct mode leaves the batch as it is (the objective computes its coefficient itself)
    same, _ = opd_annotate(batch, opd_rl("direct"))
    assert same is batch


# ------------------------------------------------------------------------------ direct mode: the estimator


def test_direct_gradient_is_the_exact_reverse_kl_gradient_on_a_categorical():
    """One token from softmax(θ) over K: E_y[∇ surrogate] (enumerated exactly) == ∇ KL(π ‖ π_T)."""
    k = 6
    g = torch.Generator().manual_seed(3)
    theta0 = torch.randn(k, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64), -1)
    one = torch.ones(1, 1, dtype=torch.float64)

    def expected_gradient(per_token):
        total = torch.zeros(k, dtype=torch.float64)
        probs = torch.softmax(theta0, -1)
        for y in range(k):
            theta = theta0.clone().requires_grad_(True)
            logp = torch.log_softmax(theta, -1)[y].reshape(1, 1)
            per_token(logp, teacher[y].reshape(1, 1)).sum().backward()
            total += probs[y] * theta.grad
        return total

    theta = theta0.clone().requires_grad_(True)
    logq = torch.log_softmax(theta, -1)
    (logq.exp() * (logq - teacher)).sum().backward()
    exact = theta.grad
    estimator = expected_gradient(lambda lp, tl: reverse_kl_surrogate(lp, tl, one))
    assert torch.allclose(estimator, exact, atol=1e-12) and exact.abs().max() > 1e-2
    # the objective's form: clipped surrogate with A = −c, on-policy (π_old = sg[ℓ]) — same gradient
    clipped = expected_gradient(lambda lp, tl: clipped_policy_gradient_loss(
        lp, lp.detach(), -reverse_kl_coefficients(lp, tl, one), one, epsilon_low=0.2, epsilon_high=0.2,
        lower_bound_ratio=3.0)[0])
    assert torch.allclose(clipped, exact, atol=1e-12)
    # the naive pathwise k1, ℓ − sg[ℓ^T], has expected gradient zero on-policy
    naive = expected_gradient(lambda lp, tl: lp - tl.detach())
    assert naive.abs().max() < 1e-12


def test_direct_gradient_sequence_level_and_myopic_on_two_tokens():
    """Two tokens, π(y1) π(y2|y1) tabular: γ=1 gives ∇ of the sequence KL, γ=0 the token-level (myopic) one."""
    k = 3
    g = torch.Generator().manual_seed(4)
    a0, b0 = torch.randn(k, generator=g, dtype=torch.float64), torch.randn(k, k, generator=g, dtype=torch.float64)
    ta = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64), -1)
    tb = torch.log_softmax(torch.randn(k, k, generator=g, dtype=torch.float64), -1)
    mask = torch.ones(1, 2, dtype=torch.float64)

    def expected_gradient(gamma):
        ga, gb = torch.zeros_like(a0), torch.zeros_like(b0)
        with torch.no_grad():
            p1, p2 = torch.softmax(a0, -1), torch.softmax(b0, -1)
        for y1, y2 in itertools.product(range(k), range(k)):
            a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
            logp = torch.stack([torch.log_softmax(a, -1)[y1], torch.log_softmax(b, -1)[y1, y2]]).reshape(1, 2)
            tl = torch.stack([ta[y1], tb[y1, y2]]).reshape(1, 2)
            reverse_kl_surrogate(logp, tl, mask, discount=gamma).sum().backward()
            w = p1[y1] * p2[y1, y2]
            ga += w * a.grad
            gb += w * b.grad
        return ga, gb

    def exact_gradient(myopic):
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl1 = (la.exp() * (la - ta)).sum()
        kl2_given = (lb.exp() * (lb - tb)).sum(-1)  # [k]: KL of the second token given y1
        weight = la.exp().detach() if myopic else la.exp()  # myopic: the prefix distribution held fixed
        (kl1 + (weight * kl2_given).sum()).backward()
        return a.grad, b.grad

    for gamma, myopic in ((1.0, False), (0.0, True)):
        est, ex = expected_gradient(gamma), exact_gradient(myopic)
        assert all(torch.allclose(e, x, atol=1e-12) for e, x in zip(est, ex)), gamma
    # and the two differ (the discount matters for the first token)
    assert not torch.allclose(expected_gradient(1.0)[0], expected_gradient(0.0)[0], atol=1e-6)


# ------------------------------------------------------------------------------ through the trainer


def closed_form_opd(model, batch, rl):
    """On-policy step loss and gradient written out: ρ = 1 in value, dρ/dℓ = 1, so the surrogate is
    Σ_i c_i Σ_t M (−A_{i,t}) (ℓ − sg ℓ + 1) / W, A from the batch (advantage) or −c(ℓ) (direct)."""
    model = copy.deepcopy(model)
    logp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                   temperature=ObjectiveContext(MAX_LEN).temperature)  # what opd_trainer builds with
    m = batch.loss_mask
    lengths = m.sum(-1)
    knobs = rl.objective
    if knobs.loss_type == "token-mean":
        coeff, w = torch.ones_like(lengths), lengths.sum()
    else:
        w = (lengths > 0).float().sum()
        coeff = {"seq-mean-token-mean": 1 / lengths.clamp_min(1), "seq-mean-token-sum": torch.ones_like(lengths),
                 "seq-mean-token-sum-fixed": torch.full_like(lengths, 1 / MAX_LEN)}[knobs.loss_type]
    if knobs.distillation_mode == "advantage":
        adv = batch.advantages
    else:
        adv = -torch.tensor(hand_discounted(((logp.detach() - batch.teacher_logp) * m).double(), m.double(),
                                            knobs.discount).numpy()).float()
    total = (coeff * ((-adv * (logp - logp.detach() + 1.0)) * m).sum(-1)).sum() / w
    total.backward()
    return total.item(), grads_of(model)


@pytest.mark.parametrize("mode, loss_type", [("advantage", "token-mean"), ("advantage", "seq-mean-token-mean"),
                                             ("direct", "token-mean"), ("direct", "seq-mean-token-sum-fixed")])
def test_opd_invariance_micro_batches_and_ranks(mode, loss_type):
    student, teacher = tiny_model(0), tiny_model(1)
    rl = opd_rl(mode, loss_type=loss_type, opd_discount=0.8,
                **({"opd_kl_coef": 0.7, "opd_task_reward_weight": 0.5} if mode == "advantage" else {}))
    batch, _ = opd_annotate(make_batch(student, teacher), rl)
    expected_loss, expected_grads = closed_form_opd(student, batch, rl)
    results = {}
    for micro in (8, 4, 2, 3):  # 1, 2, 4 chunks and uneven 3+3+2
        trainer = opd_trainer(student, rl)
        results[micro] = (trainer.train_step(batch, micro), grads_of(trainer.model))
    ranks = run_ranks(lambda hook: opd_trainer(student, rl, hook), [batch.select(range(5)),
                                                                    batch.select(range(5, 8))], 2)
    for r, (metrics, trainer) in enumerate(ranks):
        results[f"rank{r}"] = (metrics, grads_of(trainer.model))
    base = results[8][0]
    for key, (metrics, grads) in results.items():
        assert metrics["train/loss"] == pytest.approx(expected_loss, abs=TOL), key
        assert max_diff(grads, expected_grads) <= TOL, key
        # reverse_kl uses the loss's own reduction, so it combines exactly under every loss_type
        # (entropy is a token mean: exact only when the chunk weight counts tokens)
        exact = ("train/reverse_kl", "train/grad_norm") + (("train/entropy",) if loss_type == "token-mean" else ())
        for name in exact:
            assert metrics[name] == pytest.approx(base[name], abs=TOL), (key, name)
        assert set(metrics) >= {f"train/{v}" for v in OPD_METRIC_NAMES.values()}
    assert base["train/reverse_kl"] != 0 and max(float(g.abs().max()) for g in expected_grads) > 1e-4


def test_direct_and_advantage_modes_agree_on_policy():
    """kl_coef = 1, w = 0, same γ, rollout_logp == the trainer's ℓ: the same value and gradient."""
    student, teacher = tiny_model(0), tiny_model(1)
    batch = make_batch(student, teacher)
    out = {}
    for mode in ("advantage", "direct"):
        rl = opd_rl(mode, opd_discount=0.5)
        annotated, _ = opd_annotate(batch, rl)
        trainer = opd_trainer(student, rl)
        out[mode] = (trainer.train_step(annotated, 4), grads_of(trainer.model))
    (ma, ga), (md, gd) = out["advantage"], out["direct"]
    assert max_diff(ga, gd) <= 1e-6
    assert ma["train/loss"] == pytest.approx(md["train/loss"], abs=1e-6)
    assert ma["train/reverse_kl"] == pytest.approx(md["train/reverse_kl"], abs=1e-7)


def test_direct_mode_several_updates_use_pi_old():
    student, teacher = tiny_model(0), tiny_model(1)
    trainer = LLMTrainer(copy.deepcopy(student), build_objective(opd_rl("direct"), ObjectiveContext(MAX_LEN)),
                         OptimizerConfig(lr=1e-2))
    metrics = trainer.train_step(make_batch(student, teacher), 2, mini_batch_size=4)
    assert trainer.step == 2 and trainer.objective.old_logp_cache.fills == 1
    assert metrics["train/ratio_max"] > 1.0 or metrics["train/ratio_min"] < 1.0


def sample_on_policy(student, teacher, prompts, n_resp, gen):
    """Sample `n_resp` tokens per prompt from the student (temperature 1), score them: an on-policy OPD batch."""
    b, p = prompts.shape
    ids = prompts.clone()
    with torch.no_grad():
        for _ in range(n_resp):
            logits = student(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], 1)
        att = torch.ones_like(ids)
        loss = torch.zeros(b, p + n_resp)
        loss[:, p:] = 1
        own = sequence_token_logprobs(student, ids, att, temperature=1.0) * loss
    batch = Trajectory(ids, att, loss, own, torch.zeros(b), torch.arange(b) // 2, torch.arange(b), 0)
    return batch.replace(teacher_logp=teacher_logprobs(teacher, batch, temperature=1.0))


def first_token_kl(student, teacher, prompts):
    """Exact KL(π ‖ π_T) of the first response token, averaged over prompts (full vocabulary)."""
    with torch.no_grad():
        ls = torch.log_softmax(student(input_ids=prompts).logits[:, -1], -1)
        lt = torch.log_softmax(teacher(input_ids=prompts).logits[:, -1], -1)
    return float((ls.exp() * (ls - lt)).sum(-1).mean())


@pytest.mark.slow
def test_on_policy_distillation_lowers_the_exact_kl_to_the_teacher():
    """Sample -> teacher scores -> direct-mode step, 12 times: the exact first-token KL(π ‖ π_T) falls.
    (Advantage mode takes the identical steps on-policy, see test_direct_and_advantage_modes_agree_on_policy.)"""
    student, teacher = tiny_model(0), tiny_model(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # a peaked teacher: a KL worth closing
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 20, (8, 4), generator=gen).repeat_interleave(4, 0)  # 8 prompts x 4 samples
    rl = opd_rl("direct")
    trainer = LLMTrainer(copy.deepcopy(student), build_objective(rl, ObjectiveContext(MAX_LEN)),
                         OptimizerConfig(lr=5e-3))
    before = first_token_kl(trainer.model, teacher, prompts)
    for _ in range(12):
        batch, _ = opd_annotate(sample_on_policy(trainer.model, teacher, prompts, 3, gen), rl)
        trainer.train_step(batch, 16)
    after = first_token_kl(trainer.model, teacher, prompts)
    assert after < 0.75 * before, (before, after)


def test_teacher_logprobs_and_refusals():
    student, teacher = tiny_model(0), tiny_model(1)
    batch = make_batch(student, teacher)
    with torch.no_grad():
        full = sequence_token_logprobs(teacher, batch.input_ids, batch.attention_mask, temperature=0.5)
    scored = teacher_logprobs(teacher, batch, temperature=0.5, micro_batch_size=3)
    assert torch.allclose(scored, full * batch.loss_mask, atol=1e-6) and not scored.requires_grad
    objective = build_objective(opd_rl(), ObjectiveContext(MAX_LEN))
    objective.old_logp_cache.fill_on_policy(batch.sample_ids, 0)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        objective.fn(student, batch.replace(teacher_logp=None))
    with pytest.raises(ValueError, match=r"per token \(\[B, T\]\)"):
        objective.fn(student, batch.replace(advantages=torch.zeros(8)))
    bad = batch.teacher_logp.clone()
    bad[2, 5] = float("nan")  # a loss token of row 2
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        opd_annotate(batch.replace(teacher_logp=bad), opd_rl())
    validate_teacher_logp(batch)
    with pytest.raises(BatchValidationError, match=r"teacher_logp_finite.*rows \[2\]"):
        validate_teacher_logp(batch.replace(teacher_logp=bad))
    positive = batch.teacher_logp.clone()
    positive[3, 5] = 0.5
    with pytest.raises(BatchValidationError, match=r"teacher_logp_max.*rows \[3\]"):
        validate_teacher_logp(batch.replace(teacher_logp=positive))
    with pytest.raises(BatchValidationError, match="teacher_logprobs"):
        validate_teacher_logp(batch.replace(teacher_logp=None))
    for kw in ({"kl_beta": 0.1}, {"importance_sampling_level": "sequence", "lower_bound_ratio": 0.0},
               {"grpo_surrogate": "legacy_pg"}):
        with pytest.raises(ValueError):
            build_objective(RLConfig(**kw), ObjectiveContext(MAX_LEN))


def test_identity_holds_every_value_that_changes_the_math():
    ctx = ObjectiveContext(MAX_LEN, {"name_or_path": "student"})
    adv = build_objective(opd_rl(opd_kl_coef=0.5, opd_discount=0.9, opd_task_reward_weight=0.2), ctx).identity
    assert adv["objective"] == "opd" and adv["distillation_mode"] == "advantage"
    assert (adv["opd_kl_coef"], adv["opd_discount"], adv["opd_task_reward_weight"]) == (0.5, 0.9, 0.2)
    for key in ("epsilon_low", "epsilon_high", "lower_bound_ratio", "loss_type", "temperature", "advantage_eps"):
        assert key in adv
    direct = build_objective(opd_rl("direct"), ctx).identity
    assert "opd_kl_coef" not in direct and "opd_task_reward_weight" not in direct
    assert direct["policy"] == {"name_or_path": "student"}
    idents = [build_objective(opd_rl(**kw), ctx).identity for kw in
              ({}, {"opd_discount": 0.5}, {"opd_kl_coef": 2.0}, {"loss_type": "seq-mean-token-mean"})]
    idents.append(build_objective(opd_rl(), ObjectiveContext(MAX_LEN, {"name_or_path": "student"}, 0.7)).identity)
    assert len({repr(sorted(i.items())) for i in idents}) == len(idents)


# ------------------------------------------------------------------------------ preflight


def opd_cfg(**objective):
    return config_from_dict({"rl": {"objective": {"type": "opd", **objective}}})



def test_preflight_opd_knobs_only_under_opd():
    assert preflight(PosttrainConfig()).ok
    for knob, value in (("kl_coef", 2.0), ("discount", 0.5), ("task_reward_weight", 0.1)):
        found = [e for e in objective_problems(type="grpo", **{knob: value}) if e.startswith(f"rl.objective.{knob}=")]
        assert found and "rl.objective.type=opd" in found[0], knob
        assert preflight(opd_cfg(**{knob: value})).ok, knob
    cfg = PosttrainConfig()
    cfg.model.teacher = "artifacts/teacher"
    assert any(e.startswith("model.teacher=") for e in preflight(cfg).errors)
    cfg = opd_cfg()
    cfg.model.teacher = "artifacts/teacher"
    assert preflight(cfg).ok
    assert any(e.startswith("rl.objective.beta=") for e in objective_problems(type="opd", beta=0.5))


def test_preflight_direct_mode_rejects_advantage_only_knobs_and_warns():
    for knob, value in (("kl_coef", 2.0), ("task_reward_weight", 0.1)):
        found = objective_problems(type="opd", distillation_mode="direct", **{knob: value})
        assert any(e.startswith(f"rl.objective.{knob}=") and "direct" in e for e in found), knob
    ok = preflight(opd_cfg(distillation_mode="direct", discount=1.0))
    assert ok.ok and any("not training signals" in w for w in ok.warnings)


def test_preflight_opd_refuses_what_it_never_reads():
    assert any(e.startswith("rl.objective.kl_beta=") for e in objective_problems(type="opd", kl_beta=0.1))
    assert any(e.startswith("rl.objective.surrogate=") for e in objective_problems(type="opd", surrogate="legacy_pg"))
    assert any(e.startswith("rl.objective.shared_prefix_min_tokens=") for e in objective_problems(type="opd", shared_prefix_min_tokens=4))
    found = objective_problems(type="opd", unbiased_advantage=True)
    assert any(e.startswith("rl.objective.unbiased_advantage=") and "task_reward_weight" in e for e in found)
    assert preflight(opd_cfg(unbiased_advantage=True, task_reward_weight=0.5)).ok
