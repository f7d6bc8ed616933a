"""vLLM serving the policy's LoRA adapters (rl_core/rollout/vllm.py, rl_core/model/lora.py), run for real with vLLM's CPU
build: after a sync vLLM's greedy completions and sampling log-probs are the HF PEFT model's, and not the base's.

One in-process engine for the module (the engine changes its host process: a module of its own)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOL = 1e-5  # tests/infra/workers/test_vllm_cpu.py: vLLM's sampling log-probs against the trainer's
MAX_TOKENS = 6
LORA_R = 8


def prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (int(k),), generator=g).tolist() for k in torch.randint(3, 9, (n,), generator=g)]


def nontrivial_adapter(model, seed):
    """Adapters that change the model: lora_B drawn non-zero (PEFT initialises it to 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def setup(workdir):
    from rl_core.config.schema import LoRAConfig, ModelConfig
    from rl_core.model import lora
    from rl_core.model.loading import load_policy
    from rl_core.rollout.vllm import VLLMEngine

    base_dir = str(workdir / "artifacts" / "tiny-model" / "init")
    base, tokenizer = load_policy(ModelConfig(name_or_path=base_dir))
    base.eval()
    cfg = LoRAConfig(r=LORA_R, alpha=16.0)
    torch.manual_seed(0)
    policy = lora.wrap(load_policy(ModelConfig(name_or_path=base_dir))[0], cfg).eval()
    engine = VLLMEngine(base_dir, tokenizer, dtype="float32", max_model_len=64, seed=0,
                        lora_config=lora.adapter_config_dict(cfg, base_dir))
    yield base, policy, tokenizer, engine
    # the engine lives in this pytest worker: its torch.distributed world goes with it, so that later modules of the
    # worker start without a default process group
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    del engine.llm
    cleanup_dist_env_and_memory()


def hf_greedy(model, tokenizer, ids):
    from rl_core.rollout import HFEngine, SamplingParams

    return HFEngine(model, tokenizer).generate(ids, 1, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS,
                                                                      greedy=True, seed=0))


def greedy():
    from rl_core.rollout import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, greedy=True, seed=0)


def trainer_logprobs(model, completions):
    from rl_core.primitives.logprobs import sequence_token_logprobs

    with torch.no_grad():
        lp = sequence_token_logprobs(model, completions.input_ids, completions.attention_mask, temperature=1.0)
    return lp * completions.response_mask


def test_vllm_serves_the_synced_adapter_like_the_peft_model(setup):
    from rl_core.model import lora

    base, policy, tokenizer, engine = setup
    ids = prompts()
    before = engine.generate(ids, 1, greedy())
    assert torch.equal(before.input_ids, hf_greedy(base, tokenizer, ids).input_ids)  # no adapter yet: the base

    nontrivial_adapter(policy, seed=1)
    engine.update_weights(lora.adapter_state(policy, torch.float32), 1)
    after = engine.generate(ids, 1, greedy())
    assert after.policy_version == 1
    expected = hf_greedy(policy, tokenizer, ids)
    assert torch.equal(after.input_ids, expected.input_ids)
    diff = (after.sampling_logp - trainer_logprobs(policy, after)).abs().max().item()
    assert diff < TOL, f"vLLM's log-probs with the adapter differ from the PEFT model's by {diff}"
    assert not torch.equal(after.input_ids, before.input_ids)  # the adapter changed what is generated
    assert (after.sampling_logp - trainer_logprobs(base, after)).abs().max().item() > 100 * TOL


def test_a_new_version_replaces_the_old_adapter(setup):
    from rl_core.model import lora

    _base, policy, tokenizer, engine = setup
    old = engine.lora_request
    nontrivial_adapter(policy, seed=2)
    engine.update_weights(lora.adapter_state(policy, torch.float32), 2)
    new = engine.lora_request
    assert new.lora_int_id != old.lora_int_id and not os.path.exists(old.lora_path)
    assert engine.llm.llm_engine.list_loras() == {new.lora_int_id}
    ids = prompts(seed=3)
    out = engine.generate(ids, 1, greedy())
    assert torch.equal(out.input_ids, hf_greedy(policy, tokenizer, ids).input_ids)
    diff = (out.sampling_logp - trainer_logprobs(policy, out)).abs().max().item()
    assert diff < TOL
