"""Reward-model training (rl.objective.type=reward_model) and reward models as rewards: the Bradley–Terry loss and
its gradient against closed forms, its invariance to the micro-batch/rank split, the score read at the last real
token, the builder, the rendering and batching of a scored completion, normalisation, the config rules and the
reward-hacking check."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.reward_model import (
    RM_METRIC_NAMES,
    RewardModel,
    bradley_terry_loss,
    pair_accuracy,
    reward_model,
    sequence_scores,
)
from rl_core.config import ConfigError, OptimizerConfig, config_from_dict
from rl_core.data.preferences import pair_rows, pairs_to_trajectory
from rl_core.evaluation.hacking import HackingWatch
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.preflight.machine import machine_problems
from rl_core.preflight.rules import preflight
from rl_core.rewards import RewardInputs
from rl_core.rewards.model import ModelScorer, normalized, render, resolve_reward_model
from rl_core.training.trainer import LLMTrainer
from tests.builders import PREFERENCE_PAIRS
from tests.ranks import run_ranks

TOKENIZER = build_tiny_tokenizer()
NO_CLIP = OptimizerConfig(lr=1e-3, max_grad_norm=1e9)
TOL = 1e-6
PAIRS = PREFERENCE_PAIRS


def tiny_rm(seed: int = 0):
    """A 2-layer random Llama with a one-output score head (random, so every parameter has a gradient)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                      pad_token_id=TOKENIZER.pad_token_id)
    return LlamaForSequenceClassification(cfg)


def alone(model, ids: list[int]) -> float:
    """A row's score computed by hand: the unpadded row through the backbone, the head at its last token."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return float(model.score(hidden[0, -1]))


def grads_of(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def trainer(model, hook=None, margin=0.0, center=0.0):
    objective = RewardModel(margin=margin, center_coef=center).build(None, ObjectiveContext(8))
    return LLMTrainer(copy.deepcopy(model), objective, NO_CLIP, dp_reducer=hook)


# ------------------------------------------------------------------------------ the loss


def test_bradley_terry_loss_and_gradient_match_the_closed_form():
    chosen = torch.tensor([1.5, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.5, 0.4, 0.3], dtype=torch.float64, requires_grad=True)
    m, c = 0.25, 0.1
    loss = bradley_terry_loss(chosen, rejected, margin=m, center_coef=c)
    loss.sum().backward()
    for i in range(3):
        w, lose = float(chosen[i].detach()), float(rejected[i].detach())
        delta = w - lose
        by_hand = -math.log(1 / (1 + math.exp(-(delta - m)))) + c * (w + lose) ** 2
        assert float(loss[i]) == pytest.approx(by_hand, abs=1e-12)
        sig = 1 / (1 + math.exp(delta - m))  # σ(m − Δ)
        assert float(chosen.grad[i]) == pytest.approx(-sig + 2 * c * (w + lose), abs=1e-12)
        assert float(rejected.grad[i]) == pytest.approx(sig + 2 * c * (w + lose), abs=1e-12)
    zero = torch.zeros(4)
    assert torch.allclose(bradley_terry_loss(zero, zero), torch.full((4,), math.log(2)))
    assert torch.allclose(bradley_terry_loss(zero, zero, margin=1.0), torch.full((4,), math.log(1 + math.e)))
    assert float(pair_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))) == pytest.approx(0.5)


def test_score_is_read_at_the_last_real_token_whatever_the_padding():
    model = tiny_rm(0).eval()
    batch = pairs_to_trajectory(PAIRS, TOKENIZER)  # prompts left-padded, responses right-padded
    scores = sequence_scores(model, batch.input_ids, batch.attention_mask)
    for row in range(batch.batch_size):
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert float(scores[row]) == pytest.approx(alone(model, real), abs=1e-5), row
    assert len({round(float(s), 6) for s in scores}) > 8  # the rows differ: nothing constant was read


def test_training_loss_gradient_and_metrics_are_the_hand_computation_for_any_split():
    model = tiny_rm(0)
    batch = pairs_to_trajectory(PAIRS, TOKENIZER)
    ref = copy.deepcopy(model)
    scores = sequence_scores(ref, batch.input_ids, batch.attention_mask)
    w, lose = scores[0::2], scores[1::2]
    expected = (torch.nn.functional.softplus(-(w - lose - 0.5)) + 0.05 * (w + lose) ** 2).mean()
    expected.backward()
    expected_grads = grads_of(ref)
    results = {}
    for micro in (16, 8, 4):  # 1, 2, 4 chunks of equal pairs
        t = trainer(model, margin=0.5, center=0.05)
        results[micro] = (t.train_step(batch, micro), grads_of(t.model))
    ranks = run_ranks(lambda hook: trainer(model, hook, margin=0.5, center=0.05),
                      [batch.select(pair_rows(range(4))), batch.select(pair_rows(range(4, 8)))], 4)
    for r, (metrics, t) in enumerate(ranks):
        results[f"rank{r}"] = (metrics, grads_of(t.model))
    accuracy = float(((w > lose).double() + 0.5 * (w == lose).double()).mean())
    for key, (metrics, grads) in results.items():
        assert metrics["train/loss"] == pytest.approx(float(expected), abs=TOL), key
        assert max(float((g - e).abs().max()) for g, e in zip(grads, expected_grads)) <= TOL, key
        assert metrics["train/accuracy"] == pytest.approx(accuracy, abs=TOL), key
        assert metrics["train/margin"] == pytest.approx(float((w - lose).mean()), abs=TOL), key
        assert set(metrics) >= {f"train/{v}" for v in RM_METRIC_NAMES.values()}
    assert max(float(g.abs().max()) for g in expected_grads) > 1e-4


def test_training_ranks_chosen_above_rejected():
    model = tiny_rm(0)
    batch = pairs_to_trajectory(PAIRS, TOKENIZER)
    t = LLMTrainer(copy.deepcopy(model), RewardModel().build(None, ObjectiveContext(8)), OptimizerConfig(lr=3e-3))
    first = t.train_step(batch, 16)
    for _ in range(30):
        last = t.train_step(batch, 16)
    assert last["train/loss"] < first["train/loss"] - 0.3 and last["train/accuracy"] == 1.0


# ------------------------------------------------------------------------------ the builder and scoring


def test_builder_makes_a_new_zero_head_from_a_policy_and_keeps_a_trained_one(tmp_path):
    from tests.builders import tiny_model

    policy = tiny_model(0, vocab_size=len(TOKENIZER))
    policy.save_pretrained(tmp_path / "policy")
    rm = reward_model(tmp_path / "policy", pad_token_id=0)
    assert type(rm).__name__ == "LlamaForSequenceClassification" and rm.config.pad_token_id == 0
    assert float(rm.score.weight.abs().sum()) == 0.0
    assert torch.equal(rm.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    trained = tiny_rm(3)
    trained.save_pretrained(tmp_path / "rm")
    again = reward_model(tmp_path / "rm")
    assert torch.equal(again.score.weight, trained.score.weight)


def test_scoring_renders_as_the_training_pairs_and_batches_equal_one_by_one(tmp_path):
    model = tiny_rm(1)
    model.save_pretrained(tmp_path / "rm")
    TOKENIZER.save_pretrained(tmp_path / "rm")
    data = config_from_dict({"data": {"prompt_template": "plain"}}).data
    batch = pairs_to_trajectory(PAIRS, TOKENIZER, data=data)
    for k, pair in enumerate(PAIRS):
        row = batch.input_ids[2 * k][batch.attention_mask[2 * k].bool()].tolist()
        assert render(TOKENIZER, pair["prompt"], pair["chosen"], data) == row
    scorer = ModelScorer(str(tmp_path / "rm"), data=data, batch_size=3)
    prompts = [p["prompt"] for p in PAIRS for _ in range(2)]
    completions = [p[side] for p in PAIRS for side in ("chosen", "rejected")]
    batched = scorer.score(prompts, completions)
    single = ModelScorer(str(tmp_path / "rm"), data=data, batch_size=1).score(prompts, completions)
    assert batched == pytest.approx(single, abs=1e-5)
    by_hand = [alone(model, render(TOKENIZER, p, c, data)) for p, c in zip(prompts, completions)]
    assert batched == pytest.approx(by_hand, abs=1e-5)
    # a finished run's directory resolves to its final model; a directory without a model is refused by key
    (tmp_path / "run").mkdir()
    (tmp_path / "rm").rename(tmp_path / "run" / "final_model")
    assert resolve_reward_model(str(tmp_path / "run"), "k").endswith("run/final_model")
    with pytest.raises(ValueError, match=r"data.rewards\[0\].model=.*no model there"):
        resolve_reward_model(str(tmp_path / "nothing"), "data.rewards[0].model")


def test_normalisations():
    scores = [2.0, -1.0, 0.5, 0.5]
    assert normalized(scores, "none") == scores
    assert normalized(scores, "sigmoid") == pytest.approx([1 / (1 + math.exp(-s)) for s in scores])
    mean = sum(scores) / 4
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 4)
    assert normalized(scores, "batch") == pytest.approx([(s - mean) / std for s in scores])
    assert normalized([3.0, 3.0], "batch") == [0.0, 0.0]


def test_a_text_completion_is_rendered_with_its_eos():
    data = config_from_dict({"data": {"prompt_template": "plain"}}).data
    inputs = RewardInputs(["1+1="], ["2"], {}, ["row 0"])
    assert render(TOKENIZER, inputs.prompts[0], inputs.completions[0], data)[-1] == TOKENIZER.eos_token_id


# ------------------------------------------------------------------------------ config rules


def test_reward_entries_name_a_function_or_a_model_and_preflight_checks_the_model(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"weight": 1.0}]}})
    with pytest.raises(ConfigError, match="exactly one of them"):
        config_from_dict({"data": {"rewards": [{"path": "rl_core.rewards.arithmetic:exact_match", "model": "x/y"}]}})
    with pytest.raises(ConfigError, match="apply to a reward model"):
        config_from_dict({"data": {"rewards": [{"path": "rl_core.rewards.arithmetic:exact_match",
                                                "normalize": "sigmoid"}]}})
    missing = config_from_dict({"data": {"rewards": [{"model": str(tmp_path / "no-rm")}]}})
    assert preflight(missing).ok  # the config is right; this machine lacks the model
    assert any("data.rewards[0].model=" in e and "no model there" in e for e in machine_problems(missing, gpus=0))
    cfg = config_from_dict({"rl": {"objective": {"type": "reward_model"}, "reference": "x"},
                            "data": {"rewards": [{"model": "org/rm"}]}})
    errors = preflight(cfg).errors
    assert any(e.startswith("rl.reference=") for e in errors)
    assert any(e.startswith("data.rewards[0].model:") and "trains a reward model" in e for e in errors)
    odd = config_from_dict({"rl": {"objective": {"type": "reward_model"}, "micro_batch_per_replica": 3}})
    assert any("rl.micro_batch_per_replica=3" in e for e in preflight(odd).errors)


def test_plans_a_reward_model_run_without_engines_and_a_reward_model_beside_each_rank(tmp_path):
    from rl_core.placement.formulas import REWARD, SYNC
    from rl_core.placement.memory import memory_plan, plan_for_config
    from rl_core.placement.model_shape import model_shape
    from rl_core.placement.run_shape import num_engines
    from tests.builders import tiny_model

    tiny_model(0, vocab_size=len(TOKENIZER)).save_pretrained(tmp_path / "policy")
    tiny_rm(0).save_pretrained(tmp_path / "rm")
    policy, rm = model_shape(str(tmp_path / "policy")), model_shape(str(tmp_path / "rm"))
    training = config_from_dict({"model": {"name_or_path": str(tmp_path / "policy")}, "cluster": {"placement": "separate"},
                                 "rl": {"objective": {"type": "reward_model"}}})
    assert num_engines(training) == 0 and not training.rl.objective.trains_policy
    plan = memory_plan(training, policy, prompt_tokens=16)
    trainer = plan.role("trainer")
    assert [r.key for r in plan.roles] == ["trainer"] and SYNC not in trainer.phases
    assert not any(i.name.startswith(("LM head", "weight sync", "HF ", "vLLM")) for i in trainer.items)
    rlhf = config_from_dict({"model": {"name_or_path": str(tmp_path / "policy")},
                             "data": {"rewards": [{"model": str(tmp_path / "rm"), "batch_size": 4}]}})
    plan, why = plan_for_config(rlhf, prompt_tokens=16)
    trainer = plan.role("trainer")
    assert why == "" and REWARD in trainer.phases
    assert trainer.item("reward model data.rewards[0]: frozen weights").bytes == 4 * rm.n_params
    scoring = trainer.item("reward model data.rewards[0] scoring")
    assert "4 rows" in scoring.name and scoring.phases == (REWARD,)


# ------------------------------------------------------------------------------ reward hacking


def test_hacking_watch_flags_reward_up_while_accuracy_down():
    warnings: list[str] = []
    watch = HackingWatch(warnings.append)
    assert watch.check({"val/mean_reward": 0.1, "val/accuracy": 0.7}) == {"val/reward_hacking": 0.0}
    assert watch.check({"val/mean_reward": 0.5, "val/accuracy": 0.8}) == {"val/reward_hacking": 0.0}  # both up
    assert watch.check({"val/mean_reward": 0.9, "val/accuracy": 0.6}) == {"val/reward_hacking": 1.0}
    assert watch.check({"val/mean_reward": 0.8, "val/accuracy": 0.5}) == {"val/reward_hacking": 0.0}  # both down
    assert len(warnings) == 1 and "0.5 -> 0.9" in warnings[0] and "0.8 -> 0.6" in warnings[0]
