"""The Objective contract (docs/objectives.md): reduction and weight key, metric adapter, π_old cache, certified forward, identity,
module-level picklable builder, data preconditions."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from recipes.dr_grpo_gsm8k import build_config as dr_grpo_config
from recipes.gspo_gsm8k import build_config as gspo_config
from rl_core.algorithms import grpo
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import GRPO, GSPO, build_objective
from rl_core.annotators.advantage import group_advantages
from rl_core.batch.trajectory import Trajectory, TrajectoryError
from rl_core.config import OptimizerConfig, RLConfig
from rl_core.primitives.objective import (
    OBJECTIVE_WEIGHT_SUM,
    LogprobScorer,
    MetricAdapter,
    NondeterministicForwardError,
    Objective,
    OldLogpCacheError,
    Reduction,
)
from rl_core.training.trainer import LLMTrainer
from tests.builders import tiny_model

CTX = ObjectiveContext(max_response_length=24, policy_identity={"name_or_path": "tiny", "compute_dtype": "float32"})
OPT = OptimizerConfig(lr=1e-2, max_grad_norm=1e9)
RESP = [1, 3, 7, 16, 5, 2, 9, 4]
GRPO_PUBLIC = {"train/" + n for n in ("loss", "pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high",
                                      "dual_clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl_old",
                                      "entropy", "advantage_mean", "advantage_std", "rollout_logp_abs_diff",
                                      "rollout_logp_abs_diff_max", "grad_norm", "lr")}


def make_batch(resp=RESP, seed=0, policy_version=0):
    g = torch.Generator().manual_seed(seed)
    b, p = len(resp), 3
    t = p + max(resp)
    ids = torch.randint(1, 20, (b, t), generator=g)
    att = torch.zeros(b, t, dtype=torch.long)
    loss = torch.zeros(b, t)
    for i, n in enumerate(resp):
        att[i, :p + n] = 1
        loss[i, p:p + n] = 1
    ids = ids * att
    rewards = torch.tensor([1.0, 0.0] * (b // 2))
    groups = torch.arange(b) // 2
    return Trajectory(ids, att, loss, torch.zeros(b, t), rewards, groups, torch.arange(b), policy_version,
                      advantages=group_advantages(rewards, groups))


# ------------------------------------------------------------------------------ builder


def test_builder_is_module_level_and_picklable():
    assert grpo.build_objective is build_objective
    assert build_objective.__module__ == "rl_core.algorithms.grpo" and build_objective.__qualname__ == "build_objective"
    assert pickle.loads(pickle.dumps(build_objective)) is build_objective
    assert pickle.loads(pickle.dumps(CTX)) == CTX
    # the built objective travels too, and computes the same loss after the trip
    rl = RLConfig(kl_beta=0.1)
    obj = build_objective(rl, CTX)
    clone = pickle.loads(pickle.dumps(obj))
    assert clone.fn.old_logp_cache is clone.old_logp_cache  # shared cache survives the trip
    model, batch = tiny_model(), make_batch()
    batch = batch.replace(ref_logp=LogprobScorer(1.0)(model, batch))
    values = []
    for o in (obj, clone):
        o.old_logp_cache.fill_on_policy(batch.sample_ids, 0)
        values.append(o.fn(model, batch)[0].item())
    assert values[0] == values[1]


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                       "seq-mean-token-sum-fixed"])
def test_token_sum_reduction_and_weight_key(loss_type):
    obj = build_objective(RLConfig(loss_type=loss_type), CTX)
    assert obj.reduction is Reduction.TOKEN_SUM
    batch = make_batch()
    obj.old_logp_cache.fill_on_policy(batch.sample_ids, 0)
    loss, metrics = obj.fn(tiny_model(), batch)
    expected_weight = sum(RESP) if loss_type == "token-mean" else len(RESP)
    assert metrics[OBJECTIVE_WEIGHT_SUM] == expected_weight
    assert loss.requires_grad and loss.dim() == 0
    # on-policy: loss = Σ_i c_i L_i (−A_i) / weight
    a, n = batch.advantages.tolist(), RESP
    coeff = {"token-mean": n, "seq-mean-token-mean": [1] * len(n), "seq-mean-token-sum": n,
             "seq-mean-token-sum-fixed": [x / 24 for x in n]}[loss_type]
    assert loss.item() == pytest.approx(sum(-ai * ci for ai, ci in zip(a, coeff)) / expected_weight, abs=1e-6)


def test_surrogate_and_reference_selected_from_config():
    legacy = build_objective(RLConfig(grpo_surrogate="legacy_pg"), CTX)
    assert legacy.old_logp_cache is None and legacy.reference_scorer is None
    clipped = build_objective(RLConfig(), CTX)
    assert clipped.old_logp_cache is not None and clipped.old_logp_cache.certified_deterministic_forward is False
    assert build_objective(RLConfig(kl_beta=0.1), CTX).reference_scorer == LogprobScorer(1.0)
    gspo = build_objective(RLConfig(objective=GSPO(), mini_batch_per_replica=4), CTX)
    assert gspo.old_logp_cache.certified_deterministic_forward is True
    with pytest.raises(ValueError, match="lower_bound_ratio"):
        build_objective(RLConfig(importance_sampling_level="sequence", lower_bound_ratio=3.0), CTX)


# ------------------------------------------------------------------------------ identity


def test_identity_contents():
    base = build_objective(RLConfig(), CTX).identity
    for key in ("grpo_surrogate", "importance_sampling_level", "epsilon_low", "epsilon_high", "lower_bound_ratio",
                "loss_type", "fixed_divisor", "temperature", "kl_beta", "unbiased_advantage", "advantage_eps"):
        assert key in base
    assert base["policy"] == CTX.policy_identity and base["fixed_divisor"] is None

    dr = dr_grpo_config()
    ident = build_objective(dr.rl, ObjectiveContext.from_config(dr)).identity
    assert ident["fixed_divisor"] == dr.rollout.max_tokens and ident["unbiased_advantage"] is True
    assert "advantage_eps" not in ident  # not read under unbiased advantages

    gs = gspo_config()
    ident = build_objective(gs.rl, ObjectiveContext.from_config(gs)).identity
    assert (ident["importance_sampling_level"], ident["loss_type"], ident["lower_bound_ratio"]) == \
        ("sequence", "seq-mean-token-mean", 0.0)
    assert (ident["epsilon_low"], ident["epsilon_high"]) == (3e-4, 4e-4)

    legacy = build_objective(RLConfig(grpo_surrogate="legacy_pg"), CTX).identity
    assert "epsilon_low" not in legacy and "importance_sampling_level" not in legacy
    kl = build_objective(RLConfig(kl_beta=0.05, kl_estimator="k2"), CTX).identity
    assert (kl["kl_beta"], kl["kl_estimator"], kl["reference"]) == (0.05, "k2", None)

    # every math knob moves the identity
    for change in ({"epsilon_high": 0.28}, {"epsilon_low": 0.1}, {"lower_bound_ratio": 0.0},
                   {"loss_type": "seq-mean-token-sum"}, {"kl_beta": 0.1},
                   {"unbiased_advantage": True}, {"advantage_eps": 1e-4}, {"shared_prefix_min_tokens": 4}):
        assert build_objective(RLConfig(**change), CTX).identity != base, change
    # mask_truncated: in the identity only when on, so the runs before the knob keep theirs
    assert "mask_truncated" not in base
    assert build_objective(RLConfig(objective=GRPO(mask_truncated=True)), CTX).identity == {**base, "mask_truncated": True}
    hotter = ObjectiveContext(CTX.max_response_length, CTX.policy_identity, temperature=0.7)  # rollout.temperature
    assert build_objective(RLConfig(), hotter).identity == {**base, "temperature": 0.7}
    assert build_objective(RLConfig(loss_type="seq-mean-token-sum-fixed"), ObjectiveContext(64)).identity[
        "fixed_divisor"] == 64


# ------------------------------------------------------------------------------ metric adapter


def test_grpo_metrics_published_under_train_names():
    trainer = LLMTrainer(tiny_model(), build_objective(RLConfig(), CTX), OPT)
    metrics = trainer.train_step(make_batch(), 4)
    assert set(metrics) == GRPO_PUBLIC
    assert OBJECTIVE_WEIGHT_SUM not in metrics and not any("weight" in k for k in metrics)
    kl_metrics = LLMTrainer(tiny_model(), build_objective(RLConfig(kl_beta=0.1), CTX), OPT,
                            auxiliary_models={"reference": tiny_model(1)}).train_step(make_batch(), 4)
    assert set(kl_metrics) == GRPO_PUBLIC | {"train/kl"}


def test_unmapped_metric_fails_on_first_step():
    inner = build_objective(RLConfig(), CTX)

    def leaky(model, batch):
        loss, metrics = inner.fn(model, batch)
        return loss, {**metrics, "grpo_new_diagnostic": 1.0}

    obj = Objective(leaky, Reduction.TOKEN_SUM, inner.metric_adapter, old_logp_cache=inner.old_logp_cache)
    trainer = LLMTrainer(tiny_model(), obj, OPT)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(KeyError, match="grpo_new_diagnostic"):
        trainer.train_step(make_batch(), 4)
    assert trainer.step == 0 and all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # explicitly ignored: trains, not published
    adapter = MetricAdapter(dict(inner.metric_adapter.names), ignored={"grpo_new_diagnostic"})
    obj = Objective(leaky, Reduction.TOKEN_SUM, adapter, old_logp_cache=inner.old_logp_cache)
    metrics = LLMTrainer(tiny_model(), obj, OPT).train_step(make_batch(), 4)
    assert not any("new_diagnostic" in k for k in metrics)


def test_token_sum_objective_must_report_weight():
    def no_weight(model, batch):
        logp = LogprobScorer(1.0)(model, batch)
        return (logp * 0).sum().requires_grad_(), {}

    obj = Objective(no_weight, Reduction.TOKEN_SUM, MetricAdapter({}))
    with pytest.raises(KeyError, match="weight"):
        LLMTrainer(tiny_model(), obj, OPT).train_step(make_batch(), 4)


# ------------------------------------------------------------------------------ π_old cache


def test_old_logp_cache_created_once_reused_and_invalidated(monkeypatch):
    model, batch = tiny_model(), make_batch()
    obj = build_objective(RLConfig(), CTX)
    cache = obj.old_logp_cache
    trainer = LLMTrainer(copy.deepcopy(model), obj, OPT)
    filled = []
    real_fill = cache.fill
    monkeypatch.setattr(cache, "fill", lambda ids, logp, v: (filled.append(logp.clone()), real_fill(ids, logp, v)))
    metrics = trainer.train_step(batch, 2, mini_batch_size=4)  # 2 optimizer steps × 2 micro-batches
    assert cache.fills == 1 and len(filled) == 1  # computed once per collected batch
    assert cache.lookups == 4  # reused by every micro-batch of every mini-batch
    assert trainer.step == 2
    # the cached values are π_old: the initial policy, before any update
    # (micro-batches of 2 vs the whole batch: the same values up to float summation order)
    torch.testing.assert_close(filled[0], LogprobScorer(1.0)(model, batch), atol=1e-6, rtol=0)
    assert metrics["train/ratio_max"] > 1.0 or metrics["train/ratio_min"] < 1.0  # mini-batch 2 is off-policy
    # invalidated when the batch is done: a late lookup is stale
    with pytest.raises(OldLogpCacheError, match="stale"):
        cache.lookup(batch.sample_ids, 0, torch.zeros(8, batch.seq_len))
    # the next collected batch fills it again, once
    trainer.train_step(make_batch(seed=1, policy_version=1), 2, mini_batch_size=4)
    assert cache.fills == 2 and cache.lookups == 8


def test_on_policy_single_update_uses_current_policy():
    obj = build_objective(RLConfig(), CTX)
    trainer = LLMTrainer(tiny_model(), obj, OPT)
    metrics = trainer.train_step(make_batch(), 3)
    assert obj.old_logp_cache.fills == 1 and obj.old_logp_cache.lookups == 3
    assert metrics["train/ratio_min"] == metrics["train/ratio_max"] == 1.0


def test_old_logp_cache_miss_stale_and_double_fill_raise():
    obj = build_objective(RLConfig(), CTX)
    cache, model, batch = obj.old_logp_cache, tiny_model(), make_batch()
    with pytest.raises(OldLogpCacheError, match="old_logp missing"):
        obj.fn(model, batch)  # never filled
    cache.fill(batch.sample_ids[:4], LogprobScorer(1.0)(model, batch.select(range(4))), 0)
    with pytest.raises(OldLogpCacheError, match=r"old_logp missing for sample_ids \[4, 5, 6, 7\]"):
        obj.fn(model, batch)
    with pytest.raises(OldLogpCacheError, match="stale"):
        obj.fn(model, batch.select(range(4)).replace(policy_version=3))
    with pytest.raises(OldLogpCacheError, match="invalidate"):
        cache.fill_on_policy(batch.sample_ids, 0)
    obj.fn(model, batch.select([2, 0]))  # hit, any order
    cache.invalidate()
    with pytest.raises(OldLogpCacheError, match="stale"):
        obj.fn(model, batch.select(range(4)))


def test_certified_deterministic_forward_passes_and_fails_loudly():
    rl = RLConfig(certified_deterministic_forward=True)
    obj = build_objective(rl, CTX)
    trainer = LLMTrainer(tiny_model(), obj, OPT)
    trainer.train_step(make_batch(), 3, mini_batch_size=4)
    assert obj.old_logp_cache.certified_rows == 4  # the first mini-batch, checked exactly
    trainer.train_step(make_batch(seed=1, policy_version=1), 3)  # n_mini = 1: ahead pass + check too
    assert obj.old_logp_cache.fills == 2 and obj.old_logp_cache.certified_rows == 4 + 8
    # a nondeterministic forward (dropout in train mode) is caught before any update
    obj = build_objective(rl, CTX)
    flaky = LLMTrainer(tiny_model(dropout=0.5), obj, OPT)
    before = [p.detach().clone() for p in flaky.model.parameters()]
    with pytest.raises(NondeterministicForwardError, match="certified_deterministic_forward"):
        flaky.train_step(make_batch(), 4, mini_batch_size=4)
    assert flaky.step == 0 and all(torch.equal(a, b) for a, b in zip(before, flaky.model.parameters()))
    assert obj.old_logp_cache.mode == "invalidated"
    # without the flag the same model trains (and the check is what caught it)
    LLMTrainer(tiny_model(dropout=0.5), build_objective(RLConfig(), CTX), OPT).train_step(make_batch(), 4, 4)


def test_the_certificate_is_bitwise_on_cpu_and_within_the_configured_tolerance_on_an_accelerator():
    cache = build_objective(RLConfig(certified_deterministic_forward=True, certified_forward_atol=1e-3),
                            CTX).old_logp_cache
    assert cache.certify_atol(torch.device("cpu")) == 0.0
    assert cache.certify_atol(torch.device("cuda", 1)) == 1e-3  # a device object: no GPU needed to ask
    ids = torch.arange(2)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    cache.fill(ids, old, 0)
    cache.certify = True
    assert torch.equal(cache.lookup(ids, 0, old.clone()), old)
    nudged = old + torch.tensor([[0.0, 1e-6], [0.0, 0.0]])  # well inside the accelerator tolerance
    with pytest.raises(NondeterministicForwardError, match=r"bit for bit.*at 1 position\(s\), max \|diff\| = 9\.5"):
        cache.lookup(ids, 0, nudged)  # on CPU the certificate stays bitwise


# ------------------------------------------------------------------------------ data preconditions


def test_missing_advantages_named():
    obj = build_objective(RLConfig(), CTX)
    with pytest.raises(ValueError, match="batch.advantages is missing"):
        LLMTrainer(tiny_model(), obj, OPT).train_step(make_batch().replace(advantages=None), 4)


def test_missing_old_logp_named_without_cache():
    obj = build_objective(RLConfig(), CTX)
    bare = Objective(type(obj.fn)(obj.fn.settings, None), Reduction.TOKEN_SUM, obj.metric_adapter)
    with pytest.raises(ValueError, match="batch.old_logp is missing"):
        bare.fn(tiny_model(), make_batch())
    batch = make_batch()
    loss, _ = bare.fn(tiny_model(), batch.replace(old_logp=LogprobScorer(1.0)(tiny_model(), batch)))
    assert torch.isfinite(loss)


def test_missing_reference_named():
    rl = RLConfig(kl_beta=0.1)
    with pytest.raises(ValueError, match="auxiliary_models=\\{'reference'"):
        LLMTrainer(tiny_model(), build_objective(rl, CTX), OPT)
    obj = build_objective(rl, CTX)
    obj.old_logp_cache.fill_on_policy(torch.arange(8), 0)
    with pytest.raises(ValueError, match="batch.ref_logp is missing"):
        obj.fn(tiny_model(), make_batch())


def test_per_token_advantages_refused_at_sequence_level():
    batch = make_batch()
    per_token = batch.replace(advantages=batch.advantages.unsqueeze(-1) * batch.loss_mask)
    gspo = build_objective(RLConfig(objective=GSPO(), mini_batch_per_replica=4), CTX)
    with pytest.raises(ValueError, match="importance_sampling_level=sequence"):
        LLMTrainer(tiny_model(), gspo, OPT).train_step(per_token, 4, mini_batch_size=4)
    # token level takes them (OPD's advantage mode)
    token = build_objective(RLConfig(), CTX)
    LLMTrainer(tiny_model(), token, OPT).train_step(per_token, 4)


def test_legacy_pg_is_on_policy_only():
    obj = build_objective(RLConfig(grpo_surrogate="legacy_pg"), CTX)
    trainer = LLMTrainer(tiny_model(), obj, OPT)
    with pytest.raises(ValueError, match="on-policy only"):
        trainer.train_step(make_batch(), 2, mini_batch_size=4)
    metrics = trainer.train_step(make_batch(), 2)
    assert "train/clip_frac" not in metrics and "train/pg_loss" in metrics


@pytest.mark.parametrize("field, bad, needle", [
    ("loss_mask", torch.zeros(8, 5), "loss_mask must have shape"),
    ("rewards", torch.zeros(7), "rewards must have shape"),
    ("advantages", torch.zeros(8, 3), "advantages must have shape"),
    ("rollout_logp", torch.zeros(8, 19, dtype=torch.long), "rollout_logp must be floating"),
    ("sample_ids", torch.zeros(8), "sample_ids must be integer"),
    ("ref_logp", torch.zeros(3, 19), "ref_logp must have shape"),
])
def test_trajectory_shape_errors_name_the_field(field, bad, needle):
    with pytest.raises(TrajectoryError, match=needle):
        make_batch().replace(**{field: bad})


def test_trajectory_split_select_concat():
    batch = make_batch()
    parts = batch.split(3)
    assert [len(p) for p in parts] == [3, 3, 2]
    assert torch.equal(Trajectory.concat(parts).input_ids, batch.input_ids)
    sel = batch.select([5, 1])
    assert sel.sample_ids.tolist() == [5, 1] and torch.equal(sel.loss_mask[0], batch.loss_mask[5])
    assert batch.to("cpu").policy_version == 0
    with pytest.raises(TrajectoryError, match="micro_batch_size"):
        batch.split(0)
    with pytest.raises(TrajectoryError, match="loss_mask is 1 where attention_mask is 0"):
        batch.replace(attention_mask=torch.zeros_like(batch.attention_mask))
