"""Start-up reads (`infra.workers.sharded_load.read_own_shards`): a rank fills a meta-built skeleton from the checkpoint's
safetensors files itself, the computed rotary buffers as `from_pretrained` computes them; a checkpoint whose names
are not the model's own (the MoE layout transformers converts on load), or whose tensors are quantized, is left to
rank 0's load; an index that is malformed or names a file outside the model directory is a ValueError naming the
index and the key, the file never opened. The rows each rank reads under FSDP are checked by the two-rank runs of
tests/infra/workers/test_fsdp.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from infra.workers.sharded_load import checkpoint_files, read_own_shards
from tests.builders import tiny_model

INDEX = "model.safetensors.index.json"


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


def assert_nothing_read(path) -> None:
    """The checkpoint at `path` is not read rank by rank: `read_own_shards` declines it and leaves every value of
    the skeleton as it was."""
    model = skeleton(path)
    with torch.no_grad():
        for value in model.state_dict().values():
            value.fill_(7.0)
    assert not read_own_shards(model, checkpoint_files(str(path)))
    assert all(bool((value == 7.0).all()) for value in model.state_dict().values())


def test_a_checkpoint_in_another_layout_is_left_to_rank_0(tmp_path):
    from rl_core.model.loading import build_tiny_moe_model

    build_tiny_moe_model(tmp_path)  # per-expert tensors on disk, fused experts in the model
    assert_nothing_read(tmp_path)
    assert checkpoint_files(str(tmp_path / "no-such-dir")) == {} and checkpoint_files("org/model") == {}


# ----------------------------------------------------------------- the index is checked and confined to the directory


def split_checkpoint(root):
    """A split checkpoint in `root` (several files and their index); its index's JSON and the saved model."""
    saved = tiny_model(3, vocab_size=97)
    saved.save_pretrained(root, max_shard_size="20KB")
    return json.loads((root / INDEX).read_text()), saved


def first_entry(index):
    """The first `(tensor name, file name)` of an index's weight_map."""
    return next(iter(index["weight_map"].items()))


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink", "one-file symlink"])
def test_an_index_naming_a_file_outside_the_model_directory_is_refused_and_the_file_never_opened(tmp_path, escape,
                                                                                              monkeypatch):
    from safetensors.torch import save_file

    root = tmp_path / "model"
    index, _ = split_checkpoint(root)
    outside = tmp_path / "outside.safetensors"  # a readable safetensors file, outside the model directory
    name, file = first_entry(index)
    save_file({name: torch.zeros(1)}, str(outside))
    if escape == "dotdot":
        index["weight_map"][name] = "../outside.safetensors"
    elif escape == "absolute":
        index["weight_map"][name] = str(outside)
    elif escape == "symlink":  # the index names a file inside, which is a link to one outside
        (root / file).unlink()
        (root / file).symlink_to(outside)
    else:  # no index: the directory's one safetensors file is a link to one outside
        (root / INDEX).unlink()
        for each in root.glob("*.safetensors"):
            each.unlink()
        (root / "model.safetensors").symlink_to(outside)
    if escape != "one-file symlink":
        (root / INDEX).write_text(json.dumps(index))
    opened = []
    monkeypatch.setattr("safetensors.safe_open", lambda path, *a, **k: opened.append(path))
    where = "model.safetensors" if escape == "one-file symlink" else f"{INDEX}.*{re.escape(repr(name))}"
    with pytest.raises(ValueError, match=f"{where}.*outside the model directory"):
        checkpoint_files(str(root))
    assert opened == []


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_is_read(tmp_path):
    """The hub's cache layout (`models--org--name/snapshots/<rev>/` holding links to `../../blobs/<hash>`) is the
    model's own files: followed, not refused."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    _, saved = split_checkpoint(snapshot)
    blobs.mkdir()
    for each in snapshot.iterdir():
        each.rename(blobs / each.name)
        each.symlink_to(f"../../blobs/{each.name}")
    model = skeleton(snapshot)
    assert read_own_shards(model, checkpoint_files(str(snapshot)))
    assert all(torch.equal(value, saved.state_dict()[name]) for name, value in model.state_dict().items())


def deep(levels):
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    ("[]", "a JSON array, not a JSON object"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ('{"weight_map": ["model-00001-of-00002.safetensors"]}', "'weight_map' is a JSON array"),
    ('{"weight_map": {"lm_head.weight": 5}}', r"weight_map\['lm_head.weight'\] is a JSON number"),
    ('{"weight_map": {"lm_head.weight": ""}}', r"weight_map\['lm_head.weight'\] is empty"),
    ('{"weight_map": {"lm_head.weight": "a\\u0000b"}}', r"weight_map\['lm_head.weight'\].*NUL"),
    ('{"weight_map": {"lm_head.weight": "missing.safetensors"}}', r"weight_map\['lm_head.weight'\].*not a file"),
    ('{"weight_map": {"lm_head.weight": "."}}', r"weight_map\['lm_head.weight'\].*not a file"),
    ('{"weight_map": {"lm_head.weight": ' + deep(100_000) + "}}", "nested too deep"),
    ('{"weight_map": ' + deep(100_000) + "}", "nested too deep"),
])
def test_a_malformed_index_is_a_value_error_naming_the_file_and_the_key(tmp_path, text, says):
    split_checkpoint(tmp_path)
    index = tmp_path / INDEX
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"{re.escape(str(index))}.*{says}") as raised:
        checkpoint_files(str(tmp_path))
    assert "fix" in str(raised.value)  # what to do


def test_an_index_entry_that_is_a_link_loop_is_a_value_error(tmp_path):
    index, _ = split_checkpoint(tmp_path)
    name, file = first_entry(index)
    (tmp_path / file).unlink()
    (tmp_path / file).symlink_to(tmp_path / file)
    with pytest.raises(ValueError, match=rf"{INDEX}.*weight_map\[{re.escape(repr(name))}\].*not a file"):
        checkpoint_files(str(tmp_path))


# ----------------------------------------------------------------- quantized checkpoints: never read as plain weights


def test_a_checkpoint_whose_tensors_are_quantized_is_not_read_as_weights(tmp_path):
    """Slices of a quantized weight without its scales are wrong weights: a config with `quantization_config`, a
    scale or packed tensor among the files, or a weight stored in a non-float dtype (int8, float8) leaves the load
    to rank 0, nothing read."""
    from safetensors.torch import load_file, save_file

    from infra.workers import sharded_load

    saved = tiny_model(3, vocab_size=97)
    saved.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    files = checkpoint_files(str(tmp_path))
    assert sharded_load.quantized(config, files) is None
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert "quantization_config" in sharded_load.quantized(config, files)
    config = AutoConfig.from_pretrained(tmp_path)
    for scale in ("weight_scale", "weight_scale_inv", "scales", "qweight"):
        name = f"model.layers.0.mlp.down_proj.{scale}"
        assert name in sharded_load.quantized(config, {**files, name: files["lm_head.weight"]})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for dtype in (torch.int8, torch.float8_e4m3fn):
        weight = "model.layers.0.mlp.down_proj.weight"
        save_file({**tensors, weight: tensors[weight].to(dtype)}, str(tmp_path / "model.safetensors"),
                  metadata={"format": "pt"})
        assert_nothing_read(tmp_path)


def test_the_policy_of_a_quantized_checkpoint_is_loaded_by_rank_0_and_a_bad_index_refused(tmp_path, monkeypatch):
    """`load_sharded_policy` on one gloo rank (in this process): the plain checkpoint is read as own shards; with
    `quantization_config` in its config.json it takes rank 0's load (`model.posttrain_load` says which); an index
    naming a file outside the directory is a ValueError before anything is read."""
    import torch.distributed as dist

    from infra.workers.sharded_load import load_sharded_policy
    from rl_core.config.schema import ModelConfig
    from rl_core.model import loading
    from rl_core.model.loading import build_tiny_model

    plain, quantized = build_tiny_model(tmp_path / "plain"), build_tiny_model(tmp_path / "quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    rank_0_loads, load = [], loading.load_policy

    def load_policy(model_cfg, **kwargs):  # rank 0's load: the float weights (transformers would dequantize)
        rank_0_loads.append(model_cfg.name_or_path)
        return load(ModelConfig(name_or_path=str(plain)), **kwargs)

    monkeypatch.setattr(loading, "load_policy", load_policy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        own, _ = load_sharded_policy(ModelConfig(name_or_path=str(plain)), cpu, torch.float32, (1, 1))
        assert own.posttrain_load == "own shards" and rank_0_loads == []
        broadcast, _ = load_sharded_policy(ModelConfig(name_or_path=str(quantized)), cpu, torch.float32, (1, 1))
        assert broadcast.posttrain_load == "rank 0" and rank_0_loads == [str(quantized)]
        expected = own.state_dict()
        assert all(torch.equal(value.full_tensor(), expected[name].full_tensor())
                   for name, value in broadcast.state_dict().items())
        split = tmp_path / "split"
        index, _ = split_checkpoint(split)
        loading.build_tiny_tokenizer().save_pretrained(split)
        index["weight_map"][first_entry(index)[0]] = "../outside.safetensors"
        (split / INDEX).write_text(json.dumps(index))
        with pytest.raises(ValueError, match="outside the model directory"):
            load_sharded_policy(ModelConfig(name_or_path=str(split)), cpu, torch.float32, (1, 1))
        assert rank_0_loads == [str(quantized)]
    finally:
        dist.destroy_process_group()
