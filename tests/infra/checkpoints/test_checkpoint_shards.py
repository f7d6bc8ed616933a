"""infra.checkpoints.shards in one process (no process group): what it refuses to write or read.

The sharded and multi-rank paths run in tests/infra/workers/test_fsdp.py (gloo ranks in subprocesses).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from infra.checkpoints.shards import SHARD_INDEX, full_tensors, read_shards, write_shards
from infra.checkpoints.store import CheckpointError


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


def test_saves_reuse_one_stagers_buffers_and_hash_the_files_as_they_are_written(tmp_path, monkeypatch):
    """Two saves of the same tensors: the second refills the host copies the first made (the stager's buffers do not
    grow) and each checkpoint holds the values of its own moment; the data files' sha256 comes from the bytes as
    written (only the small index is read back); the buffers are freed on request (before the final export); a save
    while the last one is still being written is refused."""
    from concurrent.futures import Future

    from infra.checkpoints import shards

    monkeypatch.setattr(shards, "_stager", None)  # this test's own stager, whatever earlier saves staged
    read_back = []
    real_sha = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda path: read_back.append(path.name) or real_sha(path))
    w = torch.arange(12.0).reshape(3, 4)
    moment = torch.tensor([3], dtype=torch.int64)
    tensors = {"model": {"w": w}, "optimizer": {"w": {"step": moment}}}
    first = write_shards(tensors, tmp_path / "one").result()
    stager = shards._stager
    buffers = len(stager._state_dict_stager._cached_storage_mapping)
    assert buffers == 2  # one host copy per tensor storage
    w.mul_(-1)
    moment.add_(1)
    second = write_shards(tensors, tmp_path / "two").result()
    assert shards._stager is stager and len(stager._state_dict_stager._cached_storage_mapping) == buffers
    assert torch.equal(full_tensors(tmp_path / "one")["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(full_tensors(tmp_path / "two")["w"], -torch.arange(12.0).reshape(3, 4))
    for directory, files in (("one", first), ("two", second)):
        for name, entry in files.items():
            data = (tmp_path / directory / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(read_back) == [SHARD_INDEX, SHARD_INDEX]  # the .distcp files were hashed while written
    shards.release_staging()  # before the final export: the buffers go, a later save stages anew
    assert shards._stager is None

    monkeypatch.setattr(shards, "_writing", Future())  # the last save still in flight
    with pytest.raises(RuntimeError, match="still being written"):
        write_shards(tensors, tmp_path / "three")
