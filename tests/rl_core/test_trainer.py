"""LLMTrainer (docs/objectives.md): accumulation invariance over micro-batches and simulated data-parallel ranks,
weight-0 chunks, clipping, schedule, KL anchor, temperature and exact resume. Tiny random Llama on CPU."""

from __future__ import annotations

import copy
import io
import random

import numpy as np
import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import build_objective
from rl_core.batch.trajectory import Trajectory
from rl_core.config import OptimizerConfig, RLConfig
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import MetricAdapter, Objective, Reduction
from rl_core.training.trainer import LLMTrainer
from tests.builders import grpo_batch, tiny_model
from tests.ranks import RankReducer, run_ranks

LOSS_TYPES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-fixed"]
MAX_LEN = 24
RESP = [1, 3, 7, 16, 5, 2, 9, 4]
PROMPT = [4, 2, 3, 4, 1, 4, 2, 3]
NO_CLIP = OptimizerConfig(lr=1e-3, max_grad_norm=1e9)
TOL = 1e-6


def make_batch(resp=RESP, prompt=PROMPT, seed=0, policy_version=0):
    return grpo_batch(resp, prompt, seed, policy_version)


def grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


def closed_form_grpo(model, batch, loss_type, kl_beta=0.0, ref_model=None, temperature=1.0):
    """On-policy GRPO step loss and gradient, written out here: ρ = 1 in value, dρ/dℓ = 1, so the
    surrogate is Σ_i c_i Σ_t M (−A_i ℓ_{i,t}) / W; plus β · k3 with the same reduction."""
    model = copy.deepcopy(model)
    logp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)
    m = batch.loss_mask
    lengths = m.sum(-1)
    if loss_type == "token-mean":
        coeff, w = torch.ones_like(lengths), lengths.sum()
    else:
        w = (lengths > 0).float().sum()
        coeff = {"seq-mean-token-mean": 1 / lengths.clamp_min(1), "seq-mean-token-sum": torch.ones_like(lengths),
                 "seq-mean-token-sum-fixed": torch.full_like(lengths, 1 / MAX_LEN)}[loss_type]
    adv = batch.advantages.unsqueeze(-1)
    surrogate = ((-adv * (logp - logp.detach() + 1.0)) * m).sum(-1)
    total = (coeff * surrogate).sum() / w
    if kl_beta:
        ref = sequence_token_logprobs(ref_model, batch.input_ids, batch.attention_mask, temperature=temperature)
        d = (ref - logp).clamp(-20, 20)
        k3 = (torch.exp(d) - d - 1).clamp(-10, 10)
        total = total + kl_beta * (coeff * (k3 * m).sum(-1)).sum() / w
    total.backward()
    return total.item(), grads_of(model)


def grpo_trainer(model, rl, hook=None, opt=NO_CLIP, aux=None, temperature=1.0):
    """`temperature`: rollout.temperature, which the trainer's log-probs follow."""
    return LLMTrainer(copy.deepcopy(model), build_objective(rl, ObjectiveContext(MAX_LEN, temperature=temperature)), opt,
                      auxiliary_models=aux, dp_reducer=hook)


# ------------------------------------------------------------------------------ invariance


@pytest.mark.parametrize("loss_type, kl", [(lt, False) for lt in LOSS_TYPES]
                         + [("token-mean", True), ("seq-mean-token-mean", True)])
def test_grpo_invariance_micro_batches_and_ranks(loss_type, kl):
    model, batch = tiny_model(0), make_batch()
    ref = tiny_model(1) if kl else None
    rl = RLConfig(loss_type=loss_type, kl_beta=0.1 if kl else 0.0)
    aux = {"reference": ref} if kl else None
    expected_loss, expected_grads = closed_form_grpo(model, batch, loss_type, 0.1 if kl else 0.0, ref)

    results = {}
    for micro in (8, 4, 3, 2):  # 1, 2, 3 (3+3+2) and 4 micro-batches
        trainer = grpo_trainer(model, rl, aux=aux)
        metrics = trainer.train_step(batch, micro)
        results[micro] = (metrics, grads_of(trainer.model))
    # 2 simulated ranks with uneven shares (5 + 3 rows), uneven micro-batches inside
    ranks = run_ranks(lambda hook: grpo_trainer(model, rl, hook, aux=aux), [batch.select(range(5)),
                                                                             batch.select(range(5, 8))], 2)
    for r, (metrics, trainer) in enumerate(ranks):
        results[f"rank{r}"] = (metrics, grads_of(trainer.model))

    for key, (metrics, grads) in results.items():
        assert metrics["train/loss"] == pytest.approx(expected_loss, abs=TOL), key
        assert max_diff(grads, expected_grads) <= TOL, key
        assert max_diff(grads, results[8][1]) <= TOL, key
        assert metrics["train/grad_norm"] == pytest.approx(results[8][0]["train/grad_norm"], abs=TOL), key
        if kl:
            assert metrics["train/kl"] == pytest.approx(results[8][0]["train/kl"], abs=TOL) and metrics["train/kl"] > 0
    assert max(float(g.abs().max()) for g in expected_grads) > 1e-3  # the comparison is not vacuous
    # both ranks end with identical weights
    (_, t0), (_, t1) = ranks
    assert all(torch.equal(a, b) for a, b in zip(t0.model.parameters(), t1.model.parameters()))


def with_environment_turns(batch: Trajectory) -> Trajectory:
    """The batch as an agent's: every response longer than 4 tokens gets an environment message after its second
    token (two real tokens the policy did not sample: attention 1, loss 0), as `rl_core.agents` lays episodes out."""
    loss = batch.loss_mask.clone()
    for row in loss:
        on = row.nonzero().flatten()
        if len(on) > 4:
            row[on[2:4]] = 0
    return batch.replace(loss_mask=loss)


@pytest.mark.parametrize("loss_type", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-fixed"])
def test_grpo_invariance_holds_on_multi_turn_batches_with_holes_in_the_loss_mask(loss_type):
    """The loss and gradient of a batch whose loss mask has holes (an agent's tool results and user turns) equal
    the closed form on exactly the sampled tokens, whatever the micro-batches, the token budget or the ranks."""
    model, batch = tiny_model(0), with_environment_turns(make_batch())
    holes = (batch.attention_mask.bool() & (batch.loss_mask == 0)).sum() - (make_batch().attention_mask.bool()
                                                                             & (make_batch().loss_mask == 0)).sum()
    assert holes == 2 * sum(n > 4 for n in RESP)  # the environment's tokens: read by the model, not trained on
    rl = RLConfig(loss_type=loss_type)
    expected_loss, expected_grads = closed_form_grpo(model, batch, loss_type)
    results = {}
    for micro, budget in ((8, None), (3, None), (8, 40)):  # whole, 3+3+2 rows, rows by length under 40 tokens
        trainer = grpo_trainer(model, rl)
        results[(micro, budget)] = (trainer.train_step(batch, micro, micro_batch_max_tokens=budget), grads_of(trainer.model))
    ranks = run_ranks(lambda hook: grpo_trainer(model, rl, hook), [batch.select(range(5)), batch.select(range(5, 8))], 2)
    for r, (metrics, trainer) in enumerate(ranks):
        results[f"rank{r}"] = (metrics, grads_of(trainer.model))
    for key, (metrics, grads) in results.items():
        assert metrics["train/loss"] == pytest.approx(expected_loss, abs=TOL), key
        assert max_diff(grads, expected_grads) <= TOL, key
    # not vacuous: training on the environment's tokens too would give another gradient
    _, leaky = closed_form_grpo(model, make_batch(), loss_type)
    assert max_diff(leaky, expected_grads) > 1e-4


class SequenceMeanLoss:
    """A MEAN objective: −mean_i A_i · (mean_t ℓ_{i,t}) over the chunk's rows."""

    def __call__(self, model, batch):
        logp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0)
        m = batch.loss_mask
        per_seq = (logp * m).sum(-1) / m.sum(-1)
        loss = -(batch.advantages * per_seq).mean()
        return loss, {"toy_loss": loss.item(), "toy_adv_max": float(batch.advantages.max())}


def mean_objective():
    return Objective(SequenceMeanLoss(), Reduction.MEAN, MetricAdapter({"toy_loss": "loss", "toy_adv_max": "adv_max"}))


def test_mean_objective_invariance_micro_batches_and_ranks():
    resp = [1, 3, 7, 16, 5, 2, 9, 4, 11, 6, 1, 8]
    batch, model = make_batch(resp=resp, prompt=[1 + i % 4 for i in range(12)]), tiny_model(0)
    ref_model = copy.deepcopy(model)
    ref_loss = SequenceMeanLoss()(ref_model, batch)[0]
    ref_loss.backward()
    expected = grads_of(ref_model)
    results = []
    for micro in (12, 6, 4, 3):
        trainer = LLMTrainer(copy.deepcopy(model), mean_objective(), NO_CLIP)
        results.append((trainer.train_step(batch, micro), grads_of(trainer.model)))
    for metrics, trainer in run_ranks(lambda hook: LLMTrainer(copy.deepcopy(model), mean_objective(), NO_CLIP,
                                                              dp_reducer=hook),
                                      [batch.select(range(6)), batch.select(range(6, 12))], 3):
        results.append((metrics, grads_of(trainer.model)))
    for metrics, grads in results:
        assert metrics["train/loss"] == pytest.approx(ref_loss.item(), abs=TOL)
        assert max_diff(grads, expected) <= TOL
        assert metrics["train/adv_max"] == pytest.approx(float(batch.advantages.max()))  # max across chunks/ranks


def test_mean_objective_refuses_unequal_chunks():
    trainer = LLMTrainer(tiny_model(0), mean_objective(), NO_CLIP)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        trainer.train_step(make_batch(), 3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weight_zero_chunk_changes_nothing(loss_type):
    model, batch = tiny_model(0), make_batch()
    rl = RLConfig(loss_type=loss_type)
    empty = make_batch(resp=[4], prompt=[3], seed=5)
    empty = empty.replace(loss_mask=torch.zeros_like(empty.loss_mask), sample_ids=torch.tensor([999]),
                          advantages=torch.tensor([5.0]))
    # pad the empty row to the batch width (left padding) so the batches concatenate
    pad = batch.seq_len - empty.seq_len
    empty = Trajectory(*(torch.nn.functional.pad(getattr(empty, f), (pad, 0)) for f in
                         ("input_ids", "attention_mask", "loss_mask", "rollout_logp")),
                       empty.rewards, empty.group_ids, empty.sample_ids, 0, advantages=empty.advantages)
    with_empty = Trajectory.concat([batch, empty])  # rows 0..7, then the weight-0 row alone in its chunk
    base = grpo_trainer(model, rl)
    m0 = base.train_step(batch, 4)
    t1 = grpo_trainer(model, rl)
    m1 = t1.train_step(with_empty, 4)  # chunks 4, 4, 1(weight 0)
    assert m1 == m0
    assert all(torch.equal(a, b) for a, b in zip(grads_of(base.model), grads_of(t1.model)))
    # the weight-0 row mixed into a chunk: still the same step (B counts only L_i > 0)
    mixed = Trajectory.concat([batch.select(range(3)), empty, batch.select(range(3, 8))])
    t2 = grpo_trainer(model, rl)
    m2 = t2.train_step(mixed, 9)
    assert m2["train/loss"] == pytest.approx(m0["train/loss"], abs=TOL)
    assert max_diff(grads_of(t2.model), grads_of(base.model)) <= TOL
    # a rank holding only the weight-0 row takes part in the collectives and changes nothing
    ranks = run_ranks(lambda hook: grpo_trainer(model, rl, hook), [batch, empty], 3)
    for metrics, trainer in ranks:
        assert metrics["train/loss"] == pytest.approx(m0["train/loss"], abs=TOL)
        assert max_diff(grads_of(trainer.model), grads_of(base.model)) <= TOL


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_filtered_batch_trains_as_its_useful_rows_given_directly(loss_type):
    """Dynamic sampling (rl_core/batch/dynamic_sampling.py) short of its groups at the cap, train fallback: the batch
    holds the useful groups, then a dropped group as padding, out of the loss. Its loss and gradient equal the
    closed form of the useful rows alone and the step on those rows given directly, whatever the micro-batches or
    ranks: the padding counts in no divisor (the token count, the sequence count, the fixed divisor's rows)."""
    from rl_core.annotate import annotate
    from rl_core.batch.dynamic_sampling import DynamicSampling, select_groups
    from rl_core.rollout.base import concat_completions
    from tests.builders import scored_round

    picker = DynamicSampling(4, max_rounds=1, fallback="train")
    picker.add(scored_round([10, 11, 12, 13], [[1, 0, 0], [1, 1, 1], [0, 0, 0], [0, 1, 1]], seed=3))
    picker.add(scored_round([14, 15], [[1, 1, 1], [2, 0, 1]], seed=4))  # the cap: one extra round
    selected = picker.select()
    assert selected.rows == [10, 13, 15, 11] and selected.padding == [3]  # 3 useful groups, then 11 (all correct)
    rl = RLConfig(loss_type=loss_type)
    filtered = annotate(selected.completions, selected.scores.rewards, selected.rows, rl=rl, first_sample_id=0,
                        padding=selected.padding).batch
    # the useful rows given directly: rounds 0 (groups 0, 3) and 1 (group 1), joined as engine shards are
    useful = concat_completions([select_groups(picker.rounds[0].completions, [0, 3]),
                                 select_groups(picker.rounds[1].completions, [1])])
    direct = annotate(useful, selected.scores.rewards[:9], selected.rows[:3], rl=rl, first_sample_id=0).batch
    assert filtered.batch_size == 12 and direct.batch_size == 9 and torch.equal(filtered.advantages[:9],
                                                                              direct.advantages)
    model = tiny_model(0)
    expected_loss, expected_grads = closed_form_grpo(model, direct, loss_type)
    results = {"direct": (grpo_trainer(model, rl), direct, 9)}
    for micro in (12, 3, 5):  # whole; 4 chunks, the last all padding; 5 + 5 + 2 rows
        results[f"filtered micro {micro}"] = (grpo_trainer(model, rl), filtered, micro)
    out = {key: (trainer.train_step(batch, micro), trainer) for key, (trainer, batch, micro) in results.items()}
    ranks = run_ranks(lambda hook: grpo_trainer(model, rl, hook), [filtered.select(range(7)),
                                                                    filtered.select(range(7, 12))], 3)
    out.update({f"rank{r}": result for r, result in enumerate(ranks)})
    for key, (metrics, trainer) in out.items():
        assert metrics["train/loss"] == pytest.approx(expected_loss, abs=TOL), key
        assert max_diff(grads_of(trainer.model), expected_grads) <= TOL, key
    assert max(float(g.abs().max()) for g in expected_grads) > 1e-3  # not vacuous
    # and the padding matters: in the loss, its tokens would count in the divisor
    leaky = annotate(selected.completions, selected.scores.rewards, selected.rows, rl=rl, first_sample_id=0).batch
    assert max_diff(closed_form_grpo(model, leaky, loss_type)[1], expected_grads) > 1e-4


def test_all_zero_weight_step_is_refused():
    batch = make_batch()
    batch = batch.replace(loss_mask=torch.zeros_like(batch.loss_mask))
    with pytest.raises(ValueError, match="global objective weight"):
        grpo_trainer(tiny_model(0), RLConfig()).train_step(batch, 4)


def test_with_skip_empty_updates_a_step_without_loss_tokens_changes_nothing_and_is_counted():
    """rl.objective.mask_truncated: a mini-batch whose every row is masked is skipped (weights and AdamW state
    unchanged), the other mini-batch of the batch is applied as it is alone, and `train/skipped_updates` counts."""
    from rl_core.algorithms.grpo import GRPO

    batch = make_batch()
    masked = batch.select(range(4)).replace(loss_mask=torch.zeros_like(batch.loss_mask[:4]))
    rest = batch.select(range(4, 8))

    def trainer():
        return LLMTrainer(copy.deepcopy(tiny_model(0)), build_objective(RLConfig(objective=GRPO()),
                                                                        ObjectiveContext(MAX_LEN)),
                          NO_CLIP, skip_empty_updates=True)

    alone = trainer()
    only = alone.train_step(rest, 4)
    both = trainer()
    combined = both.train_step(Trajectory.concat([masked, rest]), 4, 4)  # two mini-batches: masked, then rest
    assert combined.pop("train/skipped_updates") == 1.0 and combined.keys() == only.keys()
    assert all(combined[k] == pytest.approx(only[k], rel=1e-5, abs=1e-7) for k in only), (combined, only)
    assert max_diff(list(alone.model.parameters()), list(both.model.parameters())) <= 1e-6
    assert both.step == alone.step == 1 and both.policy_version == 1
    empty = trainer()
    before = [p.detach().clone() for p in empty.model.parameters()]
    assert empty.train_step(masked, 4) == {"train/skipped_updates": 1.0}
    assert all(torch.equal(a, b) for a, b in zip(before, empty.model.parameters())) and empty.step == 0
    with pytest.raises(ValueError, match="global objective weight"):  # without the option: refused, as before
        grpo_trainer(tiny_model(0), RLConfig()).train_step(masked, 4)


# ------------------------------------------------------------------------------ optimizer boundary


def test_grad_norm_reported_before_clipping_and_clip_applied():
    model, batch = tiny_model(0), make_batch()
    free = grpo_trainer(model, RLConfig())
    norm = free.train_step(batch, 4)["train/grad_norm"]
    raw = grads_of(free.model)
    assert norm == pytest.approx(float(torch.sqrt(sum((g.double() ** 2).sum() for g in raw))), rel=1e-6)
    clipped = grpo_trainer(model, RLConfig(), opt=OptimizerConfig(lr=1e-3, max_grad_norm=norm / 10))
    assert clipped.train_step(batch, 4)["train/grad_norm"] == pytest.approx(norm, rel=1e-6)
    after = grads_of(clipped.model)
    assert float(torch.sqrt(sum((g.double() ** 2).sum() for g in after))) == pytest.approx(norm / 10, rel=1e-4)
    assert max_diff(after, [g * 0.1 for g in raw]) <= 1e-6


def test_adamw_settings_and_linear_warmup_then_constant():
    opt = OptimizerConfig(lr=0.01, betas=[0.8, 0.95], weight_decay=0.1, warmup_steps=3)
    trainer = grpo_trainer(tiny_model(0), RLConfig(), opt=opt)
    group = trainer.optimizer.param_groups[0]
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
    lrs = [trainer.train_step(make_batch(seed=s), 8)["train/lr"] for s in range(5)]
    assert lrs == pytest.approx([0.01 / 3, 0.02 / 3, 0.01, 0.01, 0.01])
    assert trainer.step == 5 and trainer.policy_version == 5


def test_mini_batches_take_one_optimizer_step_each():
    trainer = grpo_trainer(tiny_model(0), RLConfig(), opt=OptimizerConfig(lr=1e-2, warmup_steps=4))
    metrics = trainer.train_step(make_batch(), 2, mini_batch_size=4)
    assert trainer.step == 2 and trainer.policy_version == 1
    assert metrics["train/lr"] == pytest.approx((0.01 / 4 + 0.02 / 4) / 2)  # averaged over the batch's two steps
    # the second mini-batch sees π_old of before the first update: ratios move away from 1
    assert metrics["train/ratio_max"] > 1.0 or metrics["train/ratio_min"] < 1.0


# ------------------------------------------------------------------------------ log-probs, KL anchor


def test_logprobs_at_the_rollout_temperature():
    model, batch = tiny_model(0), make_batch()
    out = {}
    for temperature in (1.0, 0.5):
        trainer = grpo_trainer(model, RLConfig(), temperature=temperature)
        metrics = trainer.train_step(batch, 4)
        _, expected_grads = closed_form_grpo(model, batch, "token-mean", temperature=temperature)
        assert max_diff(grads_of(trainer.model), expected_grads) <= TOL
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp_min(0)).logits[:, :-1]
            logq = torch.log_softmax(logits / temperature, -1)
            ent = -(logq.exp() * logq).sum(-1)
            m = batch.loss_mask[:, 1:]
        assert metrics["train/entropy"] == pytest.approx(float((ent * m).sum() / m.sum()), rel=1e-5)
        out[temperature] = metrics["train/entropy"]
    assert out[0.5] < out[1.0]


def test_kl_anchor_zero_against_identical_reference_and_reference_required():
    model, batch = tiny_model(0), make_batch()
    rl = RLConfig(kl_beta=0.5, kl_estimator="k3")
    trainer = grpo_trainer(model, rl, aux={"reference": copy.deepcopy(model)})
    first = trainer.train_step(batch, 4)
    assert first["train/kl"] == 0.0 and first["train/loss"] == pytest.approx(first["train/pg_loss"], abs=1e-7)
    second = trainer.train_step(batch, 4)
    assert second["train/kl"] > 0
    ref = trainer.auxiliary_models["reference"]
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))  # reference untouched
    with pytest.raises(ValueError, match="reference"):
        grpo_trainer(model, rl)


# ------------------------------------------------------------------------------ exact resume


def test_state_dict_resume_is_bitwise_identical():
    # dropout makes the RNG state load-bearing; warmup the scheduler state; AdamW the optimizer state
    opt = OptimizerConfig(lr=1e-2, warmup_steps=3, weight_decay=0.01)
    rl = RLConfig()
    batches = [make_batch(seed=s, policy_version=s) for s in range(4)]
    a = grpo_trainer(tiny_model(0, dropout=0.3), rl, opt=opt)
    for b in batches[:2]:
        a.train_step(b, 3)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    draws_a = (random.random(), float(np.random.rand()), torch.rand(3))
    metrics_a = [a.train_step(b, 3) for b in batches[2:]]

    def resumed(perturb_rng=False):
        t = grpo_trainer(tiny_model(7, dropout=0.3), rl, opt=opt)  # different init: everything comes from the state
        buf.seek(0)
        t.load_state_dict(torch.load(buf, weights_only=True))
        draws = (random.random(), float(np.random.rand()), torch.rand(3))
        if perturb_rng:
            torch.manual_seed(12345)
        return t, draws, [t.train_step(b, 3) for b in batches[2:]]

    b, draws_b, metrics_b = resumed()
    assert draws_b[:2] == draws_a[:2] and torch.equal(draws_b[2], draws_a[2])
    assert metrics_b == metrics_a
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert (b.step, b.policy_version) == (a.step, a.policy_version) == (4, 4)
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    # control: the same resume with a different torch RNG state diverges (dropout), so the check has teeth
    c, _, _ = resumed(perturb_rng=True)
    assert not all(torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))


def test_process_group_reducer_over_gloo_single_rank(tmp_path):
    import torch.distributed as dist

    from rl_core.training.data_parallel import ProcessGroupReducer

    model, batch = tiny_model(0), make_batch()
    plain = grpo_trainer(model, RLConfig())
    expected = plain.train_step(batch, 3)
    with pytest.raises(RuntimeError, match="process group"):
        ProcessGroupReducer().all_reduce_([torch.zeros(1)])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        reduced = grpo_trainer(model, RLConfig(), hook=ProcessGroupReducer())
        assert reduced.train_step(batch, 3) == expected
        assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), reduced.model.parameters()))
    finally:
        dist.destroy_process_group()


def test_with_no_option_the_step_is_the_padding_budgets_step():
    """This batch's rows, padded to its longest, cost more than twice their real tokens: with no micro-batch option
    the step is exactly the one under `padding_budget()` (the even case: test below on skewed batches)."""
    model, batch = tiny_model(0), make_batch()
    assert batch.padding_budget() is not None
    a, b = grpo_trainer(model, RLConfig()), grpo_trainer(model, RLConfig())
    assert a.train_step(batch) == b.train_step(batch, None, None, batch.padding_budget())


# ------------------------------------------------------------------------ mixed precision (bf16 compute)


def _grpo_trainer(compute_dtype, lr):
    objective = build_objective(RLConfig(), ObjectiveContext(max_response_length=MAX_LEN))
    return LLMTrainer(tiny_model(0), objective, OptimizerConfig(lr=lr), compute_dtype=compute_dtype)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def test_bf16_compute_keeps_float32_master_weights_so_a_1e6_update_lands():
    trainer = _grpo_trainer(torch.bfloat16, 1e-6)
    before = _flat(trainer.model)
    trainer.train_step(make_batch(seed=0))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    moved = (_flat(trainer.model) - before).abs()
    # AdamW's first step moves a weight by ~lr (m / sqrt(v) = sign(g)): it lands in float32 ...
    assert 0.5e-6 < float(moved.max()) <= 1.1e-6  # float32 rounding of weights near 1 (norms): 1.2e-7
    assert float((moved > 0).float().mean()) > 0.5
    # ... whereas on bf16 parameters it rounds away for every |w| >= 1e-3 (spacing >= 7.6e-6; ~1.2e-4 at 0.02)
    big = before.abs() >= 1e-3
    assert float(big.float().mean()) > 0.9
    bf16 = before[big].to(torch.bfloat16)
    assert torch.equal(bf16 + 1e-6 * torch.sign(bf16), bf16)


def test_bf16_compute_tracks_the_float32_path_over_five_steps():
    """Stated tolerance: grad norms within 0.2 %, updates at cosine >= 0.99, log-probs within 5e-3."""
    fp32, bf16 = _grpo_trainer(torch.float32, 1e-3), _grpo_trainer(torch.bfloat16, 1e-3)
    init, probe = _flat(fp32.model), make_batch(seed=99)
    norms = []
    for step in range(5):
        batch = make_batch(seed=step)
        a, b = fp32.train_step(batch), bf16.train_step(batch)
        norms.append((a["train/grad_norm"], b["train/grad_norm"]))
    for a, b in norms:
        assert abs(a - b) <= 2e-3 * a
    assert any(a != b for a, b in norms)  # the bf16 path really computed in bf16
    va, vb = _flat(fp32.model) - init, _flat(bf16.model) - init
    assert float(torch.nn.functional.cosine_similarity(va, vb, dim=0)) >= 0.99
    with torch.no_grad():
        la = sequence_token_logprobs(fp32.model, probe.input_ids, probe.attention_mask, temperature=1.0)
        lb = sequence_token_logprobs(bf16.model, probe.input_ids, probe.attention_mask, temperature=1.0)
    assert float((la - lb).abs().max()) <= 5e-3


def test_gradients_are_reduced_in_float32_buckets(monkeypatch):
    """Two simulated ranks with a bucket smaller than the model: several all-reduce calls, all float32,
    and the same update as one flat reduction."""
    batch = make_batch()
    shares = [batch.select([0, 1, 2, 3]), batch.select([4, 5, 6, 7])]
    def make(hook):
        objective = build_objective(RLConfig(), ObjectiveContext(max_response_length=MAX_LEN))
        return LLMTrainer(tiny_model(0), objective, NO_CLIP, dp_reducer=hook, compute_dtype=torch.bfloat16)

    whole = run_ranks(make, shares, micro=2)
    monkeypatch.setattr(LLMTrainer, "GRAD_BUCKET_BYTES", 4096)
    seen = []
    original = RankReducer.all_reduce_

    def spy(self, tensors):
        seen.extend((self.rank, t.dtype, t.numel()) for t in tensors)
        original(self, tensors)

    monkeypatch.setattr(RankReducer, "all_reduce_", spy)
    bucketed = run_ranks(make, shares, micro=2)
    n_params = sum(p.numel() for p in tiny_model(0).parameters())
    grad_calls = [n for r, dt, n in seen if r == 0 and dt == torch.float32]
    assert len(grad_calls) > 1 and sum(grad_calls) == n_params
    assert {dt for _, dt, _ in seen} == {torch.float32, torch.float64}  # gradients fp32, weight/metric sums fp64
    for (_, t_whole), (_, t_bucket) in zip(whole, bucketed):
        assert max_diff(list(t_whole.model.parameters()), list(t_bucket.model.parameters())) == 0.0


# ------------------------------------------------------------------------------ stale batches (rl.async_steps)


def test_a_stale_batch_is_corrected_against_its_rollout_logprobs():
    """max_staleness=1: a batch one version behind takes π_old from its rollout log-probs (ρ = π_θ / π_behaviour);
    one further behind, or from a newer policy, is refused. max_staleness=0 (the default) trains the same batch
    as before the option existed: on-policy, ρ = 1 exactly."""
    import dataclasses

    def trainer(staleness):
        t = LLMTrainer(copy.deepcopy(tiny_model(0)), build_objective(RLConfig(), ObjectiveContext(MAX_LEN)), NO_CLIP,
                       max_staleness=staleness)
        t.train_step(make_batch(seed=1, policy_version=0), 4)  # now at policy version 1
        return t

    batch = make_batch(seed=2, policy_version=0)  # sampled by version 0
    stale = trainer(1)
    with torch.no_grad():
        current = sequence_token_logprobs(stale.model, batch.input_ids, batch.attention_mask, temperature=1.0)
    shift = torch.tensor([-0.1, 0.0, 0.05]).repeat(batch.input_ids.shape[1])[: batch.input_ids.shape[1]]
    behaviour = dataclasses.replace(batch, rollout_logp=(current + shift) * batch.loss_mask)
    metrics = stale.train_step(behaviour, 4)
    on = batch.loss_mask > 0
    ratio = torch.exp(-shift).expand_as(current)[on]  # exp(ℓ_θ − ℓ_behaviour) on the loss tokens
    assert metrics["train/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert metrics["train/ratio_min"] == pytest.approx(float(ratio.min()), rel=1e-5)
    assert metrics["train/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
    assert stale.policy_version == 2

    with pytest.raises(ValueError, match=r"2 version\(s\) behind, outside 0\.\.1"):
        stale.train_step(behaviour, 4)  # version 0 at a trainer of version 2
    with pytest.raises(ValueError, match=r"-1 version\(s\) behind"):
        stale.train_step(make_batch(seed=3, policy_version=3), 4)

    unchanged = trainer(0).train_step(behaviour, 4)  # the option off: no version is compared, π_old = sg(π_θ)
    assert unchanged["train/ratio_min"] == unchanged["train/ratio_max"] == 1.0


def test_max_staleness_needs_an_objective_with_pi_old():
    legacy = build_objective(RLConfig(grpo_surrogate="legacy_pg"), ObjectiveContext(MAX_LEN))
    with pytest.raises(ValueError, match="no pi_old"):
        LLMTrainer(tiny_model(0), legacy, NO_CLIP, max_staleness=1)


def test_with_no_micro_batch_option_a_skewed_batch_is_grouped_by_length_and_a_even_one_is_not():
    """Nine rows of 2 + 3 tokens and one of 2 + 38 (real tokens 45 + 40 = 85, padded 10 x 40 = 400 > 2 x 85): the
    default groups rows by length under max(longest, real) = 85: the long row with one short (2 x 40 = 80), then the
    other eight (40), 120 tokens of forward instead of 400, the loss and gradients of the one-chunk step. Even rows
    (all 2 + 3) are one chunk in order: the very step of micro_batch_size = all rows."""
    skewed = grpo_batch([3] * 9 + [38], [2] * 10, seed=2)
    assert skewed.padding_budget() == 85
    assert [len(c) for c in skewed.token_budget_split(85)] == [2, 8]
    even = grpo_batch([3] * 8, [2] * 8, seed=2)
    assert even.padding_budget() is None

    def step(batch, rows):
        model = tiny_model()
        widths = []
        hook = model.model.register_forward_pre_hook(lambda _m, args, kwargs: widths.append(
            tuple((kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape)), with_kwargs=True)
        trainer = LLMTrainer(model, build_objective(RLConfig(), ObjectiveContext(40)), OptimizerConfig(lr=1e-2))
        metrics = trainer.train_step(batch, rows)
        hook.remove()
        return (metrics["train/loss"], metrics["train/grad_norm"]), [p.detach().clone() for p in model.parameters()], \
            widths

    loss, params, widths = step(skewed, None)
    one_loss, one_params, one_widths = step(skewed, len(skewed))
    assert len(widths) == 2 and len(one_widths) == 1
    assert sum(w[0] * w[-1] for w in widths) < sum(w[0] * w[-1] for w in one_widths)  # fewer padded positions
    assert loss == pytest.approx(one_loss, rel=1e-6)  # the loss and the gradient's norm of the unsplit step
    # one AdamW step at lr 1e-2: float rounding of near-zero gradients moves an update by at most ~1e-5
    assert max((a - b).abs().max().item() for a, b in zip(params, one_params)) < 1e-4
    loss, params, widths = step(even, None)
    one_loss, one_params, _ = step(even, len(even))
    assert len(widths) == 1 and loss == one_loss and all(torch.equal(a, b) for a, b in zip(params, one_params))
