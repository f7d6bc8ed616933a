"""infra.checkpoint_shards in one process (no process group): what it refuses to write or read.

The sharded and multi-rank paths run in tests/infra/test_fsdp.py (gloo ranks in subprocesses).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from infra.checkpoint_shards import SHARD_INDEX, full_tensors, read_shards, write_shards
from infra.storage import CheckpointError


def test_a_round_trip_its_hashes_and_what_is_refused(tmp_path):
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7], dtype=torch.int64)
    files = write_shards({"model": {"a": a}, "optimizer": {"a": {"step": b}}}, tmp_path).result()
    for name, entry in files.items():  # the reported hashes are the files' own
        data = (tmp_path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert SHARD_INDEX in files and sum(n.endswith(".distcp") for n in files) == 1
    assert torch.equal(full_tensors(tmp_path)["a"], a)

    target = {"model": {"a": torch.zeros(2, 3)}, "optimizer": {"a": {"step": torch.zeros(1, dtype=torch.int64)}}}
    read_shards(target, tmp_path)
    assert torch.equal(target["model"]["a"], a) and torch.equal(target["optimizer"]["a"]["step"], b)

    with pytest.raises(CheckpointError, match="model.missing"):  # a tensor this trainer has and the checkpoint lacks
        read_shards({"model": {"a": torch.zeros(2, 3), "missing": torch.zeros(1)}}, tmp_path)
    with pytest.raises(TypeError, match="model.lr is a float"):  # DCP would pickle it
        write_shards({"model": {"lr": 0.1}}, tmp_path / "other")

    index = json.loads((tmp_path / SHARD_INDEX).read_text())
    index["storage"][0]["file"] = "../elsewhere.distcp"
    (tmp_path / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a shard index.*plain .distcp file name"):
        read_shards(target, tmp_path)
    (tmp_path / SHARD_INDEX).write_bytes(b"\x80\x04pickle")  # DCP's own index format is never read
    with pytest.raises(CheckpointError, match="shards.json is not valid JSON"):
        read_shards(target, tmp_path)
