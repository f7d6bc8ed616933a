"""Start-up reads (`infra.workers.sharded_load.read_own_shards`): a rank fills a meta-built skeleton from the checkpoint's
safetensors files itself, the computed rotary buffers as `from_pretrained` computes them; a checkpoint whose names
are not the model's own (the MoE layout transformers converts on load) is left to rank 0's load. The rows each rank
reads under FSDP are checked by the two-rank runs of tests/infra/workers/test_fsdp.py."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from infra.workers.sharded_load import checkpoint_files, read_own_shards
from tests.builders import tiny_model


def skeleton(path):
    """The model of `path` built on the meta device, then given uninitialised memory (as every rank does)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    return model.to_empty(device="cpu")


def test_a_rank_fills_every_tensor_from_the_files_of_a_split_checkpoint(tmp_path):
    saved = tiny_model(3, vocab_size=97)
    saved.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and their index
    files = checkpoint_files(str(tmp_path))
    assert len(set(files.values())) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = skeleton(tmp_path)
    assert read_own_shards(model, files)
    expected = saved.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    buffers = dict(model.named_buffers())  # non-persistent: not in the files, computed
    assert buffers and all(torch.equal(buffers[name], value) for name, value in saved.named_buffers())


def test_a_checkpoint_in_another_layout_is_left_to_rank_0(tmp_path):
    from rl_core.model.loading import build_tiny_moe_model

    build_tiny_moe_model(tmp_path)  # per-expert tensors on disk, fused experts in the model
    model = skeleton(tmp_path)
    with torch.no_grad():
        for value in model.state_dict().values():
            value.fill_(7.0)
    assert not read_own_shards(model, checkpoint_files(str(tmp_path)))
    assert all(bool((value == 7.0).all()) for value in model.state_dict().values())  # nothing read
    assert checkpoint_files(str(tmp_path / "no-such-dir")) == {} and checkpoint_files("org/model") == {}
