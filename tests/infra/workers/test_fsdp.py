"""FSDP2 sharding (cluster.sharding=fsdp) against the unsharded trainer, on two gloo ranks on CPU.

The ranks run in subprocesses (tests/fsdp_ranks.py): the same 3 steps (2 mini-batches each, micro-
batches of one row, a weight-0 chunk on rank 1 only) unsharded and sharded, and a checkpoint taken
after 2 steps in one mode resumed for the 3rd in the other. A checkpoint the two sharded ranks write
themselves (infra.checkpoints.shards) while the 3rd step trains resumes on two ranks and, in another
process, on one unsharded rank.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.e2e  # gloo ranks in subprocesses, a flow on Ray
TOL = 1e-6


def run_ranks(tmp_path: Path, *flags: str, out_name: str = "result.json") -> dict:
    out = tmp_path / out_name
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fsdp_ranks.py"), str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("flags", [(), ("--checkpointing",)], ids=["plain", "gradient-checkpointing"])
def test_fsdp_matches_unsharded_training_and_resumes_across_modes(tmp_path, flags):
    r = run_ranks(tmp_path, *flags)
    assert r["sharded_is_dtensor"] == "DTensor"  # the model really was sharded
    assert r["steps"] == [6, 6, 6, 6, 6]  # 3 batches x 2 mini-batches in every run
    assert r["fsdp_budget_vs_plain"] <= TOL  # unequal chunk counts across ranks, padded: the same training
    assert r["moved"] > 1e-3  # training changed the weights well beyond the tolerance
    assert r["fsdp_vs_plain"] <= TOL
    assert r["optimizer_keys_equal"]  # the checkpoint keys optimizer state by parameter index in both modes
    assert r["fsdp_vs_plain_optimizer"] <= TOL
    assert r["resume_fsdp_to_plain"] <= TOL
    assert r["resume_plain_to_fsdp"] <= TOL
    assert r["resume_fsdp_to_plain_optimizer"] <= TOL
    # built sharded from a saved model (meta skeleton, rank 0 loads and broadcasts): the saved weights, bit for bit
    assert r["load_vs_saved"] == 0.0 and r["load_buffers_equal"] and r["load_local_fraction"] == 0.5
    assert r["load_path"] == "own shards"
    # a checkpoint written by both ranks while the 3rd step trained: each rank its own shard file, rank 0 the index
    ckpt = tmp_path / "result.json.ckpt"
    assert r["dcp_names"] == ["__0_0.distcp", "__1_0.distcp", "shards.json"]
    assert sorted(r["dcp_files"]) == ["__0_0.distcp", "shards.json"]  # what rank 0 wrote, hashed after the write
    for name, entry in r["dcp_files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert json.loads((ckpt / "shards.json").read_text())["format"] == "posttrain-shards"  # JSON, not DCP's pickle
    assert r["dcp_reloaded_local_equal"]  # each rank read back exactly the shard it had when the save started
    assert r["dcp_resume_2_to_2"] == 0.0 and r["dcp_resume_2_to_2_optimizer"] == 0.0 and r["dcp_steps"] == [6, 6]
    # unsharded replicas split the writing (each rank its share of the tensors) and a replica reads them all back
    assert r["replica_equal"] and min(r["replica_shard_bytes"]) > 0.3 * sum(r["replica_shard_bytes"])
    if not flags:  # the same checkpoint onto one unsharded rank, no process group, as cluster.num_workers=1 runs
        one = run_ranks(tmp_path, "--one-rank", str(ckpt), out_name="one.json")
        assert one["step"] == 6 and one["dcp_resume_2_to_1"] <= TOL


# ------------------------------------------------------------------------------ the flow on Ray


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(next((run_dir / "final_model").glob("*.safetensors")))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fsdp_flow_trains_like_unsharded_and_a_sharded_checkpoint_resumes_unsharded(in_workdir, warm_model):
    """GRPO on 2 Ray trainer ranks: fsdp and none give the same rollouts and (within 1e-5) the same final
    weights; a run checkpointed by 2 fsdp ranks at step 2 resumes on 1 unsharded rank for step 3 and lands there
    too; its last checkpoint, exported in one process, holds the final model's weights."""
    from flows.grpo import grpo
    from tests.conftest import FAST, recipe

    common = [*FAST, f"model.name_or_path={warm_model[0]}", "cluster.num_workers=2", "rl.max_steps=3", "rl.save_every=1",
              "rl.validation.before_training=false", "rl.validation.every_steps=0", "rl.validation.max_prompts=4",
              "model.gradient_checkpointing=true"]
    grpo(recipe("arithmetic"), [*common, "job.name=plain", "cluster.sharding=none"])
    grpo(recipe("arithmetic"), [*common, "job.name=fsdp", "cluster.sharding=fsdp"])
    grpo(recipe("arithmetic"), [*common, "job.name=cross", "cluster.sharding=fsdp", "rl.max_steps=2"])
    grpo(recipe("arithmetic"), [*common, "job.name=cross", "cluster.sharding=none", "cluster.num_workers=1",
                                "rl.resume=must"])
    runs = {name: in_workdir / "runs" / name for name in ("plain", "fsdp", "cross")}
    metrics = {name: _metrics(d) for name, d in runs.items()}
    assert [r["step"] for r in metrics["cross"]] == [1, 2, 3]
    for name in ("fsdp", "cross"):
        for a, b in zip(metrics["plain"], metrics[name]):
            assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
            assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5
            assert b["rollout/logp_abs_diff"] < 1e-5  # the engine's own copy got the gathered weights
    assert all(r["perf/weight_sync_bytes"] == 0 for r in metrics["fsdp"])  # colocated: in process
    assert any(r["rollout/reward_mean"] not in (0.0, 1.0) for r in metrics["plain"]), "no learning signal"
    plain = _weights(runs["plain"])
    initial = _weights_of_dir(warm_model[0])
    assert max(float((plain[k] - initial[k]).abs().max()) for k in plain) > 1e-4  # it trained
    for name in ("fsdp", "cross"):
        other = _weights(runs[name])
        assert other.keys() == plain.keys()
        assert max(float((plain[k] - other[k]).abs().max()) for k in plain) <= 1e-5, name
    # exported from the sharded ranks by rank 0 alone (gathered tensor by tensor into its host memory): a plain
    # transformers directory
    from transformers import AutoModelForCausalLM

    loaded, exported = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final_model"), _weights(runs["fsdp"])
    assert all(torch.equal(v, exported[k]) for k, v in loaded.state_dict().items() if k in exported)
    # the last step as the sharded ranks checkpointed it, exported in one process (`posttrain export`): the same
    from infra.checkpoints.export import export_checkpoint

    step3 = _weights_of_dir(export_checkpoint(runs["fsdp"], 3).path)
    assert step3.keys() == exported.keys() and all(torch.equal(step3[k], exported[k]) for k in exported)


def _weights_of_dir(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(next(Path(model_dir).glob("*.safetensors")))


def test_fsdp_with_bf16_compute_keeps_float32_masters_and_tracks_unsharded_autocast(tmp_path):
    """FSDP gathers bf16 copies of each layer (MixedPrecisionPolicy) where unsharded training autocasts:
    same float32 masters, and after 3 steps updates at cosine >= 0.99 (the bf16 tolerance of the trainer tests)."""
    r = run_ranks(tmp_path, "--bf16")
    assert r["master_dtypes"] == ["torch.float32"]
    assert r["moved"] > 1e-3
    assert r["update_cosine"] >= 0.99


def test_hsdp_on_a_2x2_mesh_matches_unsharded_training_and_resumes_unsharded(tmp_path):
    """cluster.sharding=hsdp: four gloo ranks as two shard groups of two, replicas of each other."""
    r = run_ranks(tmp_path, "--hsdp")
    assert r["mesh"] == [2, 2] and r["replicate_shard"]  # replicated across groups, sharded within one
    assert r["local_fraction"] == 0.5  # a rank holds half of each parameter: its group has two ranks
    assert r["replica_sums_equal"]  # rank k and rank k+2 hold the same shard
    assert r["steps"] == [3, 3, 3]
    assert r["moved"] > 1e-3  # training changed the weights well beyond the tolerance
    assert r["hsdp_vs_plain"] <= TOL and r["hsdp_vs_plain_optimizer"] <= TOL
    assert r["resume_hsdp_to_plain"] <= TOL
    assert r["load_vs_saved"] == 0.0 and r["load_buffers_equal"] and r["load_local_fraction"] == 0.5
    assert r["load_path"] == "own shards"
