"""LoRA through PEFT (rl_core/model/lora.py, docs/lora.md): what is trained, the reference with the adapter disabled,
adapter-only checkpoints with exact resume and the base model's identity, merged weights, the adapter count of
the memory plan, and the refused configurations. Tiny random Llama on CPU; no Ray, no Prefect."""

from __future__ import annotations

import copy
import io
from functools import partial

import pytest
import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import build_objective
from rl_core.config import LoRAConfig, OptimizerConfig, RLConfig, load_config
from rl_core.model import lora
from rl_core.preflight.rules import preflight
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.training.trainer import LLMTrainer
from tests.builders import tiny_model
from tests.rl_core.test_trainer import MAX_LEN, make_batch

ARITH = "recipes/arithmetic.py"
OPT = OptimizerConfig(lr=1e-2, warmup_steps=2, weight_decay=0.01)
LORA = LoRAConfig(r=4, alpha=8.0, dropout=0.1)


tiny_llama = partial(tiny_model, intermediate_size=48)


def lora_trainer(seed=0, lora_cfg=LORA, kl_beta=0.0, base_seed=0):
    torch.manual_seed(seed)
    model = lora.wrap(tiny_llama(base_seed), lora_cfg)
    aux = {"reference": lora.ReferenceView(model)} if kl_beta else None
    return LLMTrainer(model, build_objective(RLConfig(kl_beta=kl_beta), ObjectiveContext(MAX_LEN)), OPT,
                      auxiliary_models=aux)


def test_only_the_adapters_are_trained_and_the_base_stays_bitwise():
    t = lora_trainer()
    base_before = {k: v.clone() for k, v in lora._base_state(t.model).items()}
    names = lora.trained_names(t.model)
    # every Linear but the LM head, two tensors each: 2 layers x (q, k, v, o, gate, up, down)
    assert len(names) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert [id(p) for g in t.optimizer.param_groups for p in g["params"]] == [id(p) for p in t.params]
    assert {id(p) for p in t.params} == {id(p) for n, p in t.model.named_parameters() if n in names}
    adapters_before = [p.clone() for p in t.params]
    for s in range(3):
        t.train_step(make_batch(seed=s, policy_version=s), 4)
    after = lora._base_state(t.model)
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)
    assert all(not torch.equal(a, p) for a, p in zip(adapters_before, t.params))  # every adapter moved (B from 0)


def test_reference_view_is_the_base_model_and_leaves_the_adapters_trainable():
    t = lora_trainer(kl_beta=0.1)
    for s in range(2):
        t.train_step(make_batch(seed=s, policy_version=s), 4)
    assert all(p.requires_grad for p in t.params)  # the trainer froze its auxiliary model, not the policy
    batch = make_batch(seed=5)
    base = tiny_llama(0).eval()  # an independent copy of the initial policy
    with torch.no_grad():
        expected = sequence_token_logprobs(base, batch.input_ids, batch.attention_mask, temperature=1.0)
        ref = sequence_token_logprobs(t.auxiliary_models["reference"], batch.input_ids, batch.attention_mask,
                                      temperature=1.0)
        t.model.eval()
        policy = sequence_token_logprobs(t.model, batch.input_ids, batch.attention_mask, temperature=1.0)
    assert torch.allclose(ref, expected, atol=1e-6, rtol=0)
    assert (policy - expected).abs().max() > 1e-3  # the adapters changed the policy, not the reference
    assert t.model.training is False  # the view restores the mode it found


def test_checkpoint_holds_only_adapters_and_resume_is_bitwise():
    batches = [make_batch(seed=s, policy_version=s) for s in range(4)]
    a = lora_trainer()
    for b in batches[:2]:
        a.train_step(b, 3)
    state = a.state_dict()
    assert set(state["model"]) == set(lora.trained_names(a.model))
    assert len(state["optimizer"]["state"]) == len(a.params)
    buf = io.BytesIO()
    torch.save(state, buf)
    metrics_a = [a.train_step(b, 3) for b in batches[2:]]
    assert state[lora.BASE_KEY]["sha256"] == lora.base_identity(lora.wrap(tiny_llama(0), LORA))["sha256"]

    b = lora_trainer(seed=9)  # other adapter init: everything comes from the checkpoint
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    metrics_b = [b.train_step(x, 3) for x in batches[2:]]
    assert metrics_b == metrics_a
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    # control: without the checkpoint the other init trains to other adapters
    c = lora_trainer(seed=9)
    [c.train_step(x, 3) for x in batches[2:]]
    assert not all(torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))


def test_resume_refuses_another_base_model_naming_both():
    a = lora_trainer()
    a.train_step(make_batch(), 4)
    state = a.state_dict()
    other = lora_trainer(base_seed=1)  # same architecture and adapter shapes, other base weights
    with pytest.raises(ValueError, match="trained on base model") as info:
        other.load_state_dict(state)
    assert state[lora.BASE_KEY]["sha256"] in str(info.value)
    assert lora.base_identity(other.model)["sha256"] in str(info.value)
    full = LLMTrainer(tiny_llama(0), build_objective(RLConfig(), ObjectiveContext(MAX_LEN)), OPT)
    with pytest.raises(ValueError, match="model.lora.r=0"):
        full.load_state_dict(state)
    with pytest.raises(ValueError, match="fully fine-tuned"):
        lora_trainer().load_state_dict(full.state_dict())


def test_merged_state_equals_peft_merge_and_the_adapter_model():
    t = lora_trainer()
    for s in range(2):
        t.train_step(make_batch(seed=s, policy_version=s), 4)
    merged = lora.merged_state(t.model)
    reference = copy.deepcopy(t.model).merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    assert all(torch.allclose(merged[k], reference[k], atol=1e-7, rtol=0) for k in merged)
    plain = tiny_llama(0)
    plain.load_state_dict(merged)
    batch = make_batch(seed=3)
    t.model.eval()
    with torch.no_grad():
        lp_peft = sequence_token_logprobs(t.model, batch.input_ids, batch.attention_mask, temperature=1.0)
        lp_merged = sequence_token_logprobs(plain.eval(), batch.input_ids, batch.attention_mask, temperature=1.0)
    assert torch.allclose(lp_peft, lp_merged, atol=1e-5, rtol=0)
    # the adapter state is PEFT's saved layout: A is r x d_in, B d_out x r
    adapter = lora.adapter_state(t.model)
    q_a = next(v for k, v in adapter.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    assert q_a.shape == (LORA.r, 32) and len(adapter) == len(t.params)


def test_refused_configurations_name_the_keys():
    cfg = load_config(ARITH, ["model.lora.r=8", "cluster.sharding=fsdp", "cluster.num_workers=2"])
    errors = [e for e in preflight(cfg).errors if "model.lora" in e]
    assert len(errors) == 1 and "cluster.sharding=fsdp" in errors[0] and "cluster.sharding=none" in errors[0]
    cfg = load_config(ARITH, ["model.lora.r=600", "rollout.backend=vllm"])
    assert any("model.lora.r=600" in e and "rollout.backend=vllm" in e for e in preflight(cfg).errors)
    assert not [e for e in preflight(load_config(ARITH, ["model.lora.r=512", "rollout.backend=vllm"])).errors
                if "model.lora" in e]
    assert [lora.vllm_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]
