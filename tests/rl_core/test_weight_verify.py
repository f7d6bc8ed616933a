"""What a weight sync is verified by (rl_core.rollout.verify), without Ray: the comparison of an engine's report
with the trainer's, the HF engine's own report, a weight loaded wrong, and the trainer's bound on the sampler gap."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from rl_core.config.schema import ModelConfig
from rl_core.model.loading import build_tiny_model, load_policy
from rl_core.rollout.verify import (
    PROBE_ATOL,
    compare_held,
    fused_name,
    probe_gap,
    probe_ids,
    probe_logprobs,
    tensor_sum,
    tensor_sums,
)
from tests.conftest import recipe
from tests.faults import one_weight_wrong


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("verify") / "init", seed=0)


def report(state: dict[str, torch.Tensor], logp: list[float]) -> dict:
    return {"sums": tensor_sums(state), "probe_logp": logp}


def test_sums_of_a_fused_tensor_are_checked_against_its_parts():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    sent = {"l.q_proj.weight": q, "l.k_proj.weight": k, "l.v_proj.weight": v, "norm.weight": torch.ones(3)}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    key = fused_name("l.qkv_proj.weight", packed)
    assert key == "l.q_proj.weight+l.k_proj.weight+l.v_proj.weight"
    assert fused_name("norm.weight", packed) == "norm.weight"
    expected = {"sums": tensor_sums(sent), "probe_logp": [-1.0, -2.0]}
    fused = torch.cat([q, k, v])
    held = {"sums": {key: (float(fused.double().sum()), float(fused.double().abs().sum())),
                     "norm.weight": (3.0, 3.0)}, "probe_logp": [-1.0, -2.0]}
    assert compare_held(expected, held, "float32") == []

    bad = fused.clone()
    bad[5, 1] += 0.01  # a k_proj value, loaded wrong
    held["sums"][key] = (float(bad.double().sum()), float(bad.double().abs().sum()))
    held["sums"]["norm.weight"] = (3.5, 3.5)  # off by far more, relative to its magnitude
    problems = compare_held(expected, held, "float32")
    assert len(problems) == 2
    assert problems[0].startswith("tensor norm.weight: sum 3.5")  # the worst first
    assert problems[1].startswith(f"tensor {key}:")


def test_sums_are_taken_in_chunks_and_equal_the_float64_sums_of_the_values_as_cast():
    torch.manual_seed(0)
    x = torch.randn(1001, 7) * 3  # 7007 elements: chunks of 1000 leave a short last one
    for dtype in (None, torch.bfloat16, torch.float16):
        cast = x if dtype is None else x.to(dtype)
        want = (float(cast.double().sum()), float(cast.double().abs().sum()))
        for chunk in (1000, 7007, 1 << 22):
            got = tensor_sum(x, dtype, chunk=chunk)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-9), (dtype, chunk)
    assert tensor_sum(x.t(), torch.bfloat16, chunk=1000) == pytest.approx(  # not contiguous: a copy, same sums
        tensor_sum(x, torch.bfloat16), rel=1e-12)
    assert tensor_sum(torch.empty(0)) == (0.0, 0.0)


@pytest.mark.e2e
def test_the_sums_of_a_large_tensor_need_no_float64_copy_of_it():
    """A 512 MiB float32 tensor summed (cast to bfloat16): the process's peak memory grows by a few chunks, where
    a float64 copy would add 1 GiB (a fresh process, whose peak is this tensor)."""
    code = (
        "import resource, torch\n"
        "from rl_core.rollout.verify import tensor_sum\n"
        "x = torch.ones(1 << 27)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "total, magnitude = tensor_sum(x, torch.bfloat16)\n"
        "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(total, magnitude, grew)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) == float(out[1]) == float(1 << 27)
    assert int(out[2]) < 128 * 1024, f"peak grew by {int(out[2]) // 1024} MiB"  # ru_maxrss is in KiB


def test_a_probe_gap_is_named_and_tensors_the_trainer_did_not_send_are_left_to_the_probe():
    sent = {"a.weight": torch.ones(2)}
    expected = {"sums": tensor_sums(sent), "probe_logp": [-1.0, -2.0, -3.0]}
    held = {"sums": {"a.weight": (2.0, 2.0), "extra.k_scale": (7.0, 7.0)}, "probe_logp": [-1.0, -2.5, -3.0]}
    problems = compare_held(expected, held, "float32")
    assert len(problems) == 1
    assert problems[0].startswith("probe log-probs: token 2 of the fixed probe has log-prob -2.5 on the engine, -2 on")
    held["sums"]["a.weight"] = (2.0, 2.5)  # the same sum, another magnitude: still a mismatch
    assert compare_held(expected, held, "float32")[0].startswith("tensor a.weight: sum 2 (|x| sum 2.5)")
    assert probe_gap(expected, held) == 0.5
    # within the dtype's tolerance: nothing; NaN: named
    assert compare_held(expected, {**held, "sums": {"a.weight": (2.0, 2.0)},
                                   "probe_logp": [-1.0, -2.0 + PROBE_ATOL["float32"] / 2, -3.0]}, "float32") == []
    nan = compare_held(expected, {"sums": {}, "probe_logp": [-1.0, math.nan, -3.0]}, "float32")
    assert len(nan) == 1 and "token 2" in nan[0]


def test_the_hf_engine_reports_what_it_holds(tiny):
    """The HF engine's own report equals the trainer's of the same weights; a weight it loaded wrong is named, and
    its probe log-probs move with it."""
    from rl_core.rollout import HFEngine

    trainer_model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny)))
    engine_model, _ = load_policy(ModelConfig(name_or_path=str(tiny)))
    engine = HFEngine(engine_model, tokenizer)
    probe = probe_ids(len(tokenizer))
    assert len(set(probe)) > len(probe) // 2 and max(probe) < len(tokenizer)
    expected = report(trainer_model.state_dict(), probe_logprobs(trainer_model, probe))
    held = engine.held_weights(probe)
    assert compare_held(expected, held, "float32") == []
    assert probe_gap(expected, held) < 1e-6

    state = engine_model.state_dict()
    loaded = one_weight_wrong(state)
    name = max(state)
    assert loaded is not state
    assert torch.equal(state[name], trainer_model.state_dict()[name])  # the caller's tensor is untouched
    engine.update_weights(loaded, 1)
    problems = compare_held(expected, engine.held_weights(probe), "float32")
    assert problems[0].startswith(f"tensor {name}: ")
    assert problems[-1].startswith("probe log-probs:")


def test_a_sampler_gap_above_the_bound_refuses_the_step_before_its_update(in_workdir):
    """rollout.max_logp_abs_diff: a batch whose sampling log-probs are 0.01 off the trainer's is refused, naming
    the key, the bound and the gap, with the weights untouched; the same batch under a looser bound trains."""
    from infra.cluster.roles import RolloutRole
    from infra.workers.engines import build_engine
    from infra.workers.policy import build_trainer
    from rl_core.annotate import annotate
    from rl_core.config import load_config
    from rl_core.rewards import reward_inputs, score
    from rl_core.rewards.configured import reward_functions
    from rl_core.training.trainer import SamplerGapError

    def trainer_and_batch(bound: float):
        cfg = load_config(recipe("arithmetic"), ["model.name_or_path=artifacts/tiny-model/init", "rollout.prompts_per_step=2",
                                                 "rollout.n=4", "rollout.max_tokens=6",
                                                 f"rollout.max_logp_abs_diff={bound}"])
        role = RolloutRole.build(cfg)
        trainer, tokenizer = build_trainer(cfg, None, torch.device("cpu"))
        engine = build_engine(cfg, torch.device("cpu"), model=trainer.model, tokenizer=tokenizer)
        rows = role.sampler.next_batch()
        completions = engine.generate(role.prompts(rows), cfg.rollout.n, role.sampling(1))
        examples = [role.train[rows[i]] for i in completions.prompt_index.tolist()]
        rewards, _ = score(reward_functions(cfg.data), reward_inputs(examples, completions.decode_responses(tokenizer)))
        batch = annotate(completions, rewards, rows, rl=cfg.rl, first_sample_id=0).batch
        return trainer, batch.replace(rollout_logp=batch.rollout_logp + 0.01 * batch.loss_mask)

    trainer, batch = trainer_and_batch(0.005)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(SamplerGapError) as info:
        trainer.train_step(batch)
    message = str(info.value)
    assert message.startswith("rollout.max_logp_abs_diff=0.005: ") and "(rollout/logp_abs_diff) is 0.01" in message
    assert trainer.step == 0
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k

    trainer, batch = trainer_and_batch(0.02)
    metrics = trainer.train_step(batch)
    assert abs(metrics["train/rollout_logp_abs_diff"] - 0.01) < 1e-5 and trainer.step == 1


def test_the_bound_is_a_positive_number_and_dpo_refuses_it():
    from rl_core.config import ConfigError, load_config
    from rl_core.preflight.rules import preflight

    assert load_config(recipe("arithmetic")).rollout.max_logp_abs_diff is None  # off unless a recipe sets it
    with pytest.raises(ConfigError, match="rollout.max_logp_abs_diff"):
        load_config(recipe("arithmetic"), ["rollout.max_logp_abs_diff=0"])
    dpo = preflight(load_config(recipe("dpo_arithmetic"), ["rollout.max_logp_abs_diff=0.01"]))
    assert any(e.startswith("rollout.max_logp_abs_diff=0.01: rl.objective.type=dpo samples nothing") for e in dpo.errors)
    assert not any("max_logp_abs_diff" in e for e in preflight(load_config(
        recipe("arithmetic"), ["rollout.max_logp_abs_diff=0.01"])).errors)
