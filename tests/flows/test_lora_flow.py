"""LoRA end to end (docs/lora.md): the GRPO flow with `model.lora.r > 0` on real Prefect, Ray and MLflow.

Separate HF engine (merged weights broadcast every step): a checkpoint holds only the adapters and the base's
identity, a run cut at step 2 and resumed trains the same steps 3-4 as one run straight through, and the final
model is the merged model plus the PEFT adapter, which agree. With the tiny random-init model's reward always 0,
the KL anchor to another random model (tests.run_helpers.MATH) gives every step a gradient."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.run_helpers import assert_same_math, read_metrics, run_flow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LORA = ["model.lora.r=4", "model.lora.alpha=8", "cluster.placement=separate", "rl.save_every=2"]


def test_lora_grpo_checkpoints_adapters_resumes_exactly_and_saves_merged_and_adapter(cwd):
    from infra.checkpoints.shards import full_tensors
    from infra.checkpoints.store import CheckpointStore
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy
    from rl_core.primitives.logprobs import sequence_token_logprobs

    run_flow("job.name=straight", "rl.max_steps=4", *LORA)
    run_flow("job.name=cut", "rl.max_steps=2", *LORA)
    run_flow("job.name=cut", "rl.max_steps=4", *LORA)  # rl.resume=auto: from step 2
    straight, cut = cwd / "runs" / "straight", cwd / "runs" / "cut"
    assert_same_math(read_metrics(cut), read_metrics(straight))
    assert all(r["train/loss"] != 0 for r in read_metrics(straight)[1:])

    parts, _ = CheckpointStore(straight / "checkpoints").load(4)
    trainer = parts["trainer"]
    model = full_tensors(straight / "checkpoints" / "step_00000004")  # the shards the trainer rank wrote
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model)
    assert trainer["base_model"]["name_or_path"].endswith("artifacts/tiny-model/init")
    assert len(trainer["base_model"]["sha256"]) == 64

    adapter_a = load_file(straight / "final_model" / "adapter" / "adapter_model.safetensors")
    adapter_b = load_file(cut / "final_model" / "adapter" / "adapter_model.safetensors")
    assert adapter_a.keys() == adapter_b.keys() and all(torch.equal(adapter_a[k], adapter_b[k]) for k in adapter_a)
    assert any(k.endswith("lora_B.weight") and adapter_a[k].abs().max() > 0 for k in adapter_a)  # it trained

    from peft import PeftModel

    merged, _ = load_policy(ModelConfig(name_or_path=str(straight / "final_model")))
    base, _ = load_policy(ModelConfig(name_or_path=str(cwd / "artifacts" / "tiny-model" / "init")))
    with_adapter = PeftModel.from_pretrained(base, str(straight / "final_model" / "adapter"))
    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp_merged = sequence_token_logprobs(merged.eval(), ids, mask, temperature=1.0)
        lp_adapter = sequence_token_logprobs(with_adapter.eval(), ids, mask, temperature=1.0)
        with with_adapter.disable_adapter():
            lp_base = sequence_token_logprobs(with_adapter, ids, mask, temperature=1.0)
    assert (lp_merged - lp_adapter).abs().max() < 1e-5
    assert (lp_merged - lp_base).abs().max() > 1e-4  # the merged model is not the base


def _merged_vs_base_gap(cwd, run_dir) -> float:
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy
    from rl_core.primitives.logprobs import sequence_token_logprobs

    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for path in (run_dir / "final_model", cwd / "artifacts" / "tiny-model" / "init"):
        model, _ = load_policy(ModelConfig(name_or_path=str(path)))
        with torch.no_grad():
            out.append(sequence_token_logprobs(model.eval(), ids, torch.ones_like(ids), temperature=1.0))
    return float((out[0] - out[1]).abs().max())


@pytest.mark.parametrize("engine", [["rollout.backend=hf"],  # colocated: samples from the trainer's PEFT model
                                    ["rollout.backend=vllm", "cluster.placement=separate"]])  # adapters broadcast
def test_engines_sample_from_the_trained_adapters(cwd, engine):
    name = f"engine-{engine[0].split('=')[1]}"
    # a large lr: the adapters move the policy far from the base within a step, so a stale engine would show
    run_flow(f"job.name={name}", "rl.max_steps=3", "model.lora.r=4", "rl.optimizer.lr=0.05",
             "rl.optimizer.warmup_steps=0", *engine)
    records = read_metrics(cwd / "runs" / name)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert r["rollout/logp_abs_diff"] < 1e-5  # the engine sampled from exactly the trainer's adapters
    assert _merged_vs_base_gap(cwd, cwd / "runs" / name) > 1e-2  # ... which differ from the base
