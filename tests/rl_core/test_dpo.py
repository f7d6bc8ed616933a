"""DPO (rl_core.algorithms.dpo) and preference pairs (rl_core.data.preferences): the loss against closed
forms, micro-batch / rank invariance through LLMTrainer (Reduction.MEAN), the reference cache, the pair
gate, the arithmetic pair builder and preflight rules. Tiny random Llama + the tiny char tokenizer, CPU."""

from __future__ import annotations

import copy
import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.dpo import (
    DPO,
    DPO_METRIC_NAMES,
    build_objective,
    dpo_loss,
    evaluate_pairs,
    reference_sequence_logps,
    sequence_logps,
    with_reference_logps,
)
from rl_core.batch.gate import PreferencePairsError
from rl_core.config import OptimizerConfig, RLConfig, config_from_dict
from rl_core.data.pair_building import make_arithmetic_pairs, off_by_one_digit
from rl_core.data.preferences import (
    check_pair_layout,
    load_preference_pairs,
    pair_rows,
    pairs_to_trajectory,
    validate_preference_pairs,
)
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.preflight.rules import preflight
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.rewards.arithmetic import arithmetic_reward
from rl_core.training.trainer import LLMTrainer
from tests.builders import PREFERENCE_PAIRS, objective_problems
from tests.builders import tiny_model as build_tiny_model
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
NO_CLIP = OptimizerConfig(lr=1e-3, max_grad_norm=1e9)
TOL = 1e-6
TOKENIZER = build_tiny_tokenizer()
PAIRS = PREFERENCE_PAIRS


tiny_model = partial(build_tiny_model, vocab_size=len(TOKENIZER))


def pair_batch(ref_model, pairs=PAIRS, temperature=1.0):
    return with_reference_logps(ref_model, pairs_to_trajectory(pairs, TOKENIZER), temperature=temperature)


def grads_of(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def dpo_trainer(model, beta=0.1, hook=None, opt=NO_CLIP):
    return LLMTrainer(copy.deepcopy(model), build_objective(RLConfig(dpo_beta=beta), ObjectiveContext(8)), opt,
                      dp_reducer=hook)


def closed_form_dpo(model, ref_model, batch, beta):
    """Mean over pairs of softplus(−β[(ℓ_w − ℓ^ref_w) − (ℓ_l − ℓ^ref_l)]), sequences summed by hand."""
    model = copy.deepcopy(model)
    lp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=1.0)
    with torch.no_grad():
        rp = sequence_token_logprobs(ref_model, batch.input_ids, batch.attention_mask, temperature=1.0)
    m = batch.loss_mask
    seq, ref = (lp * m).sum(-1), (rp * m).sum(-1)
    h = beta * ((seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2]))
    loss = -torch.log(torch.sigmoid(h)).mean()
    loss.backward()
    return loss.item(), grads_of(model), h.detach()


# ------------------------------------------------------------------------------ the loss


def test_policy_equals_reference_gives_log_two():
    model = tiny_model(0)
    batch = pair_batch(copy.deepcopy(model))  # reference scored as one chunk of 16 rows
    metrics = dpo_trainer(model).train_step(batch)  # the same layout: bitwise the same log-probs
    assert metrics["train/margin"] == 0.0 and metrics["train/reward_accuracy"] == 0.0
    assert metrics["train/chosen_reward"] == 0.0 and metrics["train/rejected_reward"] == 0.0
    assert metrics["train/loss"] == float(torch.tensor(math.log(2), dtype=torch.float32))  # softplus(0), float32
    # other micro-batch layouts agree to float rounding
    assert dpo_trainer(model).train_step(batch, 4)["train/loss"] == pytest.approx(math.log(2), abs=1e-7)
    # on tensors, any logps: equal policy and reference terms give exactly log 2
    lp = -torch.rand(5, dtype=torch.float64) * 9
    loss, parts = dpo_loss(lp, lp.flip(0), lp, lp.flip(0), beta=0.37)
    assert torch.equal(loss, torch.full_like(loss, math.log(2))) and torch.equal(parts["margin"], torch.zeros(5).double())


def test_dpo_gradient_matches_the_hand_derivative():
    g = torch.Generator().manual_seed(0)
    beta = 0.3
    chosen = (-torch.rand(6, generator=g, dtype=torch.float64) * 20).requires_grad_(True)
    rejected = (-torch.rand(6, generator=g, dtype=torch.float64) * 20).requires_grad_(True)
    ref_c, ref_r = -torch.rand(6, generator=g, dtype=torch.float64) * 20, -torch.rand(6, generator=g, dtype=torch.float64) * 20
    loss, parts = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta)
    loss.mean().backward()
    h = beta * ((chosen - ref_c) - (rejected - ref_r)).detach()
    sig_neg = 1 / (1 + torch.exp(h))  # σ(−h)
    assert torch.allclose(chosen.grad, -beta * sig_neg / 6, atol=1e-15)
    assert torch.allclose(rejected.grad, beta * sig_neg / 6, atol=1e-15)
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected
    assert torch.allclose(loss, torch.log1p(torch.exp(-h)), atol=1e-14)
    assert torch.allclose(parts["chosen_reward"], beta * (chosen - ref_c).detach())
    # numerically stable at large margins
    big, _ = dpo_loss(torch.tensor([0.0, -500.0]), torch.tensor([-500.0, 0.0]), torch.zeros(2), torch.zeros(2), beta=1.0)
    assert torch.isfinite(big).all() and float(big[0]) == 0.0 and float(big[1]) == pytest.approx(500.0)


def test_dpo_model_gradient_is_the_chain_rule_through_sequence_logps():
    model, ref = tiny_model(0), tiny_model(1)
    batch = pair_batch(ref)
    beta = 0.5
    objective = build_objective(RLConfig(dpo_beta=beta), ObjectiveContext(8))
    a = copy.deepcopy(model)
    loss, metrics = objective.fn(a, batch)
    loss.backward()
    b = copy.deepcopy(model)
    lp = sequence_token_logprobs(b, batch.input_ids, batch.attention_mask, temperature=1.0)
    seq = (lp * batch.loss_mask).sum(-1)
    ref_seq = sequence_logps(batch.ref_logp, batch.loss_mask)
    h = beta * ((seq[0::2] - ref_seq[0::2]) - (seq[1::2] - ref_seq[1::2])).detach()
    weight = beta * torch.sigmoid(-h) / len(h)  # −∂loss/∂ℓ_w = ∂loss/∂ℓ_l
    (-(weight * (seq[0::2] - seq[1::2])).sum()).backward()
    assert max_diff(grads_of(a), grads_of(b)) <= 1e-7
    assert metrics["dpo_loss"] == pytest.approx(float(torch.nn.functional.softplus(-h).mean()), abs=1e-7)
    assert metrics["dpo_reward_accuracy"] == pytest.approx(float((h > 0).double().mean()))
    assert metrics["dpo_margin"] == pytest.approx(float(h.mean()), abs=1e-7)


# ------------------------------------------------------------------------------ through the trainer


def test_dpo_invariance_micro_batches_and_ranks():
    model, ref = tiny_model(0), tiny_model(1)
    batch = pair_batch(ref)  # 8 pairs, 16 rows
    expected_loss, expected_grads, h = closed_form_dpo(model, ref, batch, 0.2)
    results = {}
    for micro in (16, 8, 4):  # 1, 2, 4 chunks of equal pairs
        trainer = dpo_trainer(model, 0.2)
        results[micro] = (trainer.train_step(batch, micro), grads_of(trainer.model))
    ranks = run_ranks(lambda hook: dpo_trainer(model, 0.2, hook), [batch.select(pair_rows(range(4))),
                                                                   batch.select(pair_rows(range(4, 8)))], 4)
    for r, (metrics, trainer) in enumerate(ranks):
        results[f"rank{r}"] = (metrics, grads_of(trainer.model))
    for key, (metrics, grads) in results.items():
        assert metrics["train/loss"] == pytest.approx(expected_loss, abs=TOL), key
        assert max_diff(grads, expected_grads) <= TOL, key
        assert metrics["train/margin"] == pytest.approx(float(h.mean()), abs=TOL), key
        assert metrics["train/reward_accuracy"] == pytest.approx(float((h > 0).double().mean()), abs=TOL), key
        assert set(metrics) >= {f"train/{v}" for v in DPO_METRIC_NAMES.values()}
    assert abs(expected_loss - math.log(2)) > 1e-3 and max(float(g.abs().max()) for g in expected_grads) > 1e-4


def test_dpo_refuses_split_pairs_unequal_chunks_and_missing_reference():
    model, ref = tiny_model(0), tiny_model(1)
    batch = pair_batch(ref)
    with pytest.raises(ValueError, match="even numbers of rows"):
        dpo_trainer(model).train_step(batch, 1)  # 16 equal chunks of one row: pairs split
    with pytest.raises(ValueError, match="micro_batch_size=6"):
        dpo_trainer(model).train_step(batch, 6)  # 6 + 6 + 4 rows: Reduction.MEAN needs equal chunks
    with pytest.raises(ValueError, match="with_reference_logps"):
        dpo_trainer(model).train_step(batch.replace(ref_logp=None), 4)
    with pytest.raises(ValueError, match="same pair"):
        check_pair_layout(batch.select([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="chosen"):
        check_pair_layout(batch.select([1, 0]))


def test_reference_is_scored_once_and_reused():
    ref = tiny_model(1)
    raw = pairs_to_trajectory(PAIRS, TOKENIZER)
    calls = []
    hook = ref.register_forward_hook(lambda *a: calls.append(1))
    batch = with_reference_logps(ref, raw, micro_batch_size=4)
    assert len(calls) == 4  # 16 rows in chunks of 4
    ref_c, ref_r = reference_sequence_logps(None, batch)  # from the cache: no model needed
    trainer = dpo_trainer(tiny_model(0))
    for _ in range(3):
        trainer.train_step(batch.select(pair_rows([1, 5, 2, 7])), 4)
    assert len(calls) == 4  # training never touched the reference
    hook.remove()
    with torch.no_grad():
        full = sequence_token_logprobs(ref, raw.input_ids, raw.attention_mask, temperature=1.0)
    seq = (full * raw.loss_mask).sum(-1)
    assert torch.allclose(ref_c, seq[0::2], atol=1e-5) and torch.allclose(ref_r, seq[1::2], atol=1e-5)
    assert torch.equal(batch.ref_logp * (1 - raw.loss_mask), torch.zeros_like(raw.loss_mask))


@pytest.mark.slow
def test_dpo_training_moves_metrics_the_right_way_and_val_metrics():
    model = tiny_model(0)
    train = pair_batch(copy.deepcopy(model))
    held_out = pair_batch(copy.deepcopy(model), [{"prompt": "20+22=", "chosen": "42", "rejected": "43"},
                                                 {"prompt": "3+4=", "chosen": "7", "rejected": "6"}])
    trainer = dpo_trainer(model, beta=0.5, opt=OptimizerConfig(lr=3e-3))
    val0 = evaluate_pairs(trainer.objective, trainer.model, train, micro_batch_size=6)  # unequal chunks allowed
    assert val0["val/loss"] == pytest.approx(math.log(2), abs=1e-6) and set(val0) == {
        f"val/{v}" for v in DPO_METRIC_NAMES.values()}
    history = [trainer.train_step(train, 8) for _ in range(15)]
    after = evaluate_pairs(trainer.objective, trainer.model, train)
    assert after["val/loss"] < 0.5 * math.log(2) and after["val/reward_accuracy"] == 1.0
    assert after["val/margin"] > 0 and after["val/chosen_reward"] > after["val/rejected_reward"]
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    assert trainer.model.training  # evaluate_pairs restores the mode
    ho = evaluate_pairs(trainer.objective, trainer.model, held_out)
    assert set(ho) == set(val0) and math.isfinite(ho["val/loss"])


def test_identity_and_build():
    ctx = ObjectiveContext(8, {"name_or_path": "policy"}, temperature=0.9)  # rollout.temperature
    ident = build_objective(RLConfig(dpo_beta=0.25, reference="ref/model"), ctx).identity
    assert ident["objective"] == "dpo" and ident["dpo_beta"] == 0.25 and ident["temperature"] == 0.9
    assert ident["reference"] == "ref/model" and ident["policy"] == {"name_or_path": "policy"}
    objective = build_objective(RLConfig(objective=DPO()), ctx)
    assert objective.reduction.value == "mean" and objective.reference_scorer is None and objective.old_logp_cache is None


# ------------------------------------------------------------------------------ pairs: layout, gate, builder


def test_pairs_to_trajectory_layout():
    batch = pairs_to_trajectory(PAIRS[:3], TOKENIZER)
    assert batch.batch_size == 6 and batch.rewards.tolist() == [1.0, 0.0] * 3
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and batch.sample_ids.tolist() == list(range(6))
    check_pair_layout(batch)
    eos = TOKENIZER.eos_token_id
    for row, text in enumerate(["46", "47", "10", "11", "100", "90"]):
        resp = batch.input_ids[row][batch.loss_mask[row] > 0].tolist()
        assert resp == TOKENIZER(text, add_special_tokens=False)["input_ids"] + [eos]
        prompt = batch.input_ids[row][(batch.attention_mask[row] > 0) & (batch.loss_mask[row] == 0)].tolist()
        assert prompt == TOKENIZER(PAIRS[row // 2]["prompt"])["input_ids"]  # as the rollout encodes it (<bos>)
    sub = batch.select(pair_rows([2, 0]))
    assert sub.group_ids.tolist() == [2, 2, 0, 0]
    check_pair_layout(sub)


def test_pair_schema_refuses_empty_identical_and_over_long_pairs_naming_the_check():
    ok = validate_preference_pairs(PAIRS, tokenizer=TOKENIZER, max_prompt_tokens=8, max_response_tokens=4)
    assert len(ok) == len(PAIRS) and ok["chosen_tokens"].max() == 4  # "100" + <eos>
    cases = {
        "non_empty": [{"prompt": "1+1=", "chosen": "  ", "rejected": "3"}],
        "chosen!=rejected": [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}],
        "chosen_tokens<=max_response_tokens(3)": [{"prompt": "1+1=", "chosen": "2222", "rejected": "3"}],
        "prompt_tokens<=max_prompt_tokens(8)": [{"prompt": "1000+1000=", "chosen": "9", "rejected": "3"}],
    }
    for check, pairs in cases.items():
        limit = 3 if "response" in check else 4
        with pytest.raises(PreferencePairsError) as info:
            validate_preference_pairs(PAIRS[:2] + pairs, tokenizer=TOKENIZER, max_prompt_tokens=8,
                                      max_response_tokens=limit)
        assert check in str(info.value) and "rows [2]" in str(info.value), (check, str(info.value))
        assert set(info.value.failures["check"]) == {check}, check
    with pytest.raises(PreferencePairsError, match="field_uniqueness|unique"):
        validate_preference_pairs([dict(PAIRS[0], pair_id=3), dict(PAIRS[1], pair_id=3)])
    with pytest.raises(ValueError, match="tokenizer"):
        validate_preference_pairs(PAIRS, max_response_tokens=4)


def test_load_preference_pairs_jsonl(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PAIRS[:3]) + "\n")
    df = load_preference_pairs(path)
    assert df["pair_id"].tolist() == [0, 1, 2] and df["chosen"].tolist() == ["46", "10", "100"]
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: .*'rejected'"):
        load_preference_pairs(path)
    with pytest.raises(FileNotFoundError, match="make_arithmetic_pairs"):
        load_preference_pairs(tmp_path / "missing.jsonl")


def test_off_by_one_digit_is_wrong_and_well_formed():
    import numpy as np

    rng = np.random.default_rng(0)
    for answer in ["0", "9", "10", "19", "100", "-7", "-10", "1998", "46"]:
        for _ in range(20):
            wrong = off_by_one_digit(answer, rng)
            assert wrong != answer and int(wrong) != int(answer)
            assert wrong == str(int(wrong))  # no leading zero, no "-0"
            diffs = [i for i, (a, b) in enumerate(zip(wrong, answer)) if a != b]
            assert len(wrong) == len(answer) and len(diffs) == 1
            assert abs(int(wrong[diffs[0]]) - int(answer[diffs[0]])) == 1


def _train_file(tmp_path, workdir, n=40):
    lines = (workdir / "data" / "arithmetic" / "train.jsonl").read_text().splitlines()[:n]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_arithmetic_pairs_are_deterministic_and_correct_vs_incorrect(tmp_path, workdir):
    train = _train_file(tmp_path, workdir)
    a = make_arithmetic_pairs(train, tmp_path / "a.jsonl", seed=3)
    b = make_arithmetic_pairs(train, tmp_path / "b.jsonl", seed=3)
    make_arithmetic_pairs(train, tmp_path / "c.jsonl", seed=4)
    assert {**b, "path": a["path"]} == a
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert a["n_pairs"] == 40 and a["n_model_negatives"] == 0
    df = load_preference_pairs(a["path"])
    validate_preference_pairs(df)
    for rec in df.to_dict("records"):
        x, y = rec["prompt"].rstrip("=").split("+")
        truth = str(int(x) + int(y))
        assert rec["chosen"] == truth and arithmetic_reward(rec["chosen"], truth) == 1.0
        assert arithmetic_reward(rec["rejected"], truth) == 0.0 and rec["source"] == "off_by_one"
    # the pairs tensorise into a valid DPO batch
    check_pair_layout(pairs_to_trajectory(df, TOKENIZER))


def test_arithmetic_pairs_with_the_model_use_its_wrong_answers(tmp_path, workdir):
    warm = workdir / "artifacts" / "tiny-model" / "init"  # a random-init model: its answers are wrong
    train = _train_file(tmp_path, workdir, 24)
    out = make_arithmetic_pairs(train, tmp_path / "m.jsonl", seed=0, model_dir=warm)
    again = make_arithmetic_pairs(train, tmp_path / "m2.jsonl", seed=0, model_dir=warm)
    assert (tmp_path / "m.jsonl").read_bytes() == (tmp_path / "m2.jsonl").read_bytes() and out == {**again, "path": out["path"]}
    df = load_preference_pairs(out["path"])
    assert out["n_model_negatives"] == int((df["source"] == "model").sum()) > 0
    for rec in df.to_dict("records"):
        x, y = rec["prompt"].rstrip("=").split("+")
        truth = str(int(x) + int(y))
        assert rec["chosen"] == truth and arithmetic_reward(rec["rejected"], truth) == 0.0 and rec["rejected"]


# ------------------------------------------------------------------------------ preflight


def dpo_cfg(rollout=None, **rl):
    return config_from_dict({"rl": {"objective": {"type": "dpo", "beta": rl.pop("beta", 0.1)}, **rl},
                             "rollout": rollout or {}})



def test_preflight_dpo_rules():
    assert preflight(dpo_cfg()).ok
    assert preflight(dpo_cfg({"temperature": 0.8}, beta=0.5, reference="some/model", micro_batch_per_replica=4)).ok
    found = [e for e in objective_problems(type="grpo", beta=0.5) if e.startswith("rl.objective.beta=")]
    assert found and "rl.objective.type=dpo" in found[0]
    for knob, value in (("epsilon_high", 0.28), ("kl_beta", 0.1), ("loss_type", "seq-mean-token-mean"),
                        ("surrogate", "legacy_pg"), ("unbiased_advantage", True), ("kl_estimator", "k1"),
                        ("kl_coef", 2.0), ("distillation_mode", "direct")):
        report = objective_problems(type="dpo", **{knob: value})
        assert any(e.startswith(f"rl.objective.{knob}=") and "dpo" in e for e in report), knob
    odd = preflight(dpo_cfg(micro_batch_per_replica=3))
    assert any(e.startswith("rl.micro_batch_per_replica=3") and "pairs" in e for e in odd.errors)
