"""Checkpoint storage: exact state round-trips, atomic local checkpoints, and S3 against moto's server.

The S3 tests talk to a real S3-compatible server (moto in server mode, started on 127.0.0.1 by the
fixture below and stopped by its own pid); S3 errors are injected into the real boto3 client through
botocore's events (`tests/faults.py`), so botocore's own retries meet them, and data loss or a held upload by
wrapping it. What botocore retries and the SHA256 checksums are in test_s3.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import struct
import threading
import time
import traceback
import uuid

import boto3
import numpy as np
import pytest
import safetensors.torch
import torch
from botocore.exceptions import EndpointConnectionError

from infra.checkpoints.s3 import s3_client
from infra.checkpoints.store import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    CheckpointUnavailable,
    CheckpointUploadError,
    S3Failure,
    flatten_state,
    unflatten_state,
    verify_checkpoint,
)
from infra.processes import free_port
from rl_core.config import S3Config
from tests.faults import s3_error_answers
from tests.servers import _accepts, start_moto, stop_group

SECRET = "tEsT-sEcReT-9f2c1d7e0b4a-do-not-print"
MiB = 1024 * 1024


# ------------------------------------------------------------------------------------------ helpers

def assert_same(a, b, path="/"):
    """Deep, type-exact, bitwise equality (nan == nan, -0.0 != 0.0, bf16 compared by bytes)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}{k!r}/")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}{i}/")
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def trained_adamw(steps=3, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def small_state(value=0.0):
    return {"weights": {"w": torch.full((3, 4), value)}, "counters": {"step": 1}}


# ------------------------------------------------------------------------------------ state round trip

def test_flatten_round_trip_is_bitwise_for_optimizer_rng_numpy_and_python_state():
    model, opt = trained_adamw()
    random.seed(123)
    np.random.seed(7)
    np.random.randn()  # has_gauss=1 with a cached gaussian
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "model": model.state_dict(),  # OrderedDict with _metadata
        "optimizer": opt.state_dict(),  # int keys in state, tuples (betas), None, bools
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "complex128": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex128),
        "non_contiguous": base.t(),
        "shared": [base, base[1]],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "numpy": {"f16": np.array([[1.5, -2.0]], dtype=np.float16), "big_endian": np.arange(3, dtype=">i4"),
                  "scalar": np.float64(2.5), "int_scalar": np.int32(-4), "uint64": np.array([2**64 - 1], np.uint64)},
        "python": {0: "int key", "0": "str key", (1, "a"): [None, True, False], -5: 2**200, "big": -(2**5000)},
        "floats": [math.inf, -math.inf, math.nan, -0.0, 0.1, 1e-310],
        "tuple": (1, (2.0, "x"), []),
        "bytes": b"\x00\xff",
        "torch_types": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
    }
    tensors, skeleton = flatten_state(state)
    assert all(t.is_contiguous() for t in tensors.values())
    json.dumps(skeleton, allow_nan=False)  # strictly JSON, no NaN/Infinity literals
    # through the safetensors serializer and JSON, as on disk (and no aliasing of the originals)
    tensors = safetensors.torch.load(safetensors.torch.save(tensors))
    restored = unflatten_state(tensors, json.loads(json.dumps(skeleton)))
    assert_same(state, restored)
    assert restored["model"]._metadata == state["model"]._metadata

    # the restored states actually drive the libraries the same way as the originals
    torch.set_rng_state(restored["rng"]["torch"])
    np.random.set_state(restored["rng"]["numpy"])
    random.setstate(restored["rng"]["python"])
    draws = (torch.rand(4), np.random.randn(4), random.random())
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert torch.equal(draws[0], torch.rand(4)) and np.array_equal(draws[1], np.random.randn(4))
    assert draws[2] == random.random()

    # an optimizer restored from the flattened state continues exactly like the original
    model2, opt2 = trained_adamw(steps=0, seed=99)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optimizer"])
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_flatten_refuses_unsupported_values_naming_the_path():
    with pytest.raises(TypeError, match=r"builtins.object at /a/0"):
        flatten_state({"a": [object()]})
    with pytest.raises(TypeError, match="holds python objects"):
        flatten_state({"arr": np.array([1, "x"], dtype=object)})


# ------------------------------------------------------------------------------------ local store

def test_save_load_round_trip_layout_and_manifest(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    model, opt = trained_adamw()
    parts = {"trainer_rank0": {"model": model.state_dict(), "optimizer": opt.state_dict(),
                               "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
             "driver": {"data_cursor": 17, "policy_version": 4, "mlflow_run_id": "abc"}}
    path = store.save(12, parts, {"config_hash": "h", "step": 12})
    assert path == tmp_path / "ckpt" / "step_00000012"
    names = sorted(p.name for p in path.iterdir())
    assert names == ["driver.json", "driver.safetensors", MANIFEST, "meta.json",
                     "trainer_rank0.json", "trainer_rank0.safetensors"]
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 12 and manifest["format_version"] == 2
    assert set(manifest["files"]) == set(names) - {MANIFEST}
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in manifest["files"].values())

    loaded, meta = store.load(12)
    assert meta == {"config_hash": "h", "step": 12}
    assert_same(parts, loaded)
    assert store.list_valid() == [path] and store.latest_valid() == path


def test_a_checkpoint_others_wrote_into_is_published_with_their_hashes_and_refused_when_their_files_differ(tmp_path):
    """`begin` / `write_parts` / `commit`: the trainer ranks write shard files into the temporary directory and report
    their size and sha256; the manifest records those, and a reported file that is missing or of another size is
    never published (nor is the temporary directory left behind)."""
    store = CheckpointStore(tmp_path)
    tmp = store.begin(3)
    shard = os.urandom(5000)
    (tmp / "__0_0.distcp").write_bytes(shard)
    written = {"__0_0.distcp": {"size": len(shard), "sha256": hashlib.sha256(shard).hexdigest()}}
    store.write_parts(tmp, {"driver": {"step": 3}})
    path = store.commit(tmp, 3, {"m": 1}, written)
    manifest = verify_checkpoint(path)  # every hash, the rank's included, checks out against the files
    assert manifest["files"]["__0_0.distcp"] == written["__0_0.distcp"] and manifest["parts"] == ["driver"]
    (path / "__0_0.distcp").write_bytes(b"x" * len(shard))  # same size, other bytes: the rank's hash catches it
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(path)

    tmp = store.begin(4)
    (tmp / "__0_0.distcp").write_bytes(shard[:100])  # truncated after the rank reported it
    with pytest.raises(CheckpointError, match="reported 5000"):
        store.commit(tmp, 4, {}, written)
    tmp = store.begin(5)
    with pytest.raises(CheckpointError, match="not there"):
        store.commit(tmp, 5, {}, written)
    assert not list(tmp_path.glob(".tmp-*")) and [p.name for p in tmp_path.iterdir()] == ["step_00000003"]


def test_dir_without_manifest_is_ignored_and_stale_tmp_dirs_are_removed(tmp_path):
    store = CheckpointStore(tmp_path)
    good = store.save(1, {"s": small_state(1.0)}, {})
    crashed = store.save(2, {"s": small_state(2.0)}, {})
    (crashed / MANIFEST).unlink()  # as if the writer died before the manifest
    stale = tmp_path / ".tmp-step_00000003-deadbeef"
    stale.mkdir()
    (stale / "s.safetensors").write_bytes(b"partial")
    assert store.list_valid() == [good] and store.latest_valid() == good
    with pytest.raises(CheckpointError, match="no manifest.json"):
        store.load(2)
    store.save(4, {"s": small_state(4.0)}, {})
    assert not stale.exists()


def test_corrupted_or_unlisted_files_are_refused_and_skipped(tmp_path):
    store = CheckpointStore(tmp_path)
    older = store.save(10, {"trainer_rank0": small_state(1.0)}, {})
    newest = store.save(20, {"trainer_rank0": small_state(2.0)}, {})
    tensor_file = newest / "trainer_rank0.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the tensor bytes; size unchanged
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"trainer_rank0\.safetensors has sha256 .*older checkpoint"):
        store.load(20)
    assert store.latest_valid() == older and store.list_valid() == [older]
    parts, _ = store.load(store.latest_valid())
    assert torch.equal(parts["trainer_rank0"]["weights"]["w"], torch.full((3, 4), 1.0))

    # an unparsable manifest
    (newest / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        store.load(newest)

    # a manifest listing a pickle, with a correct checksum, is still refused
    shutil.rmtree(newest)
    newest = store.save(20, {"trainer_rank0": small_state(2.0)}, {})
    (newest / "evil.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(CheckpointError, match=r"evil\.pt.*does not list"):
        store.load(20)
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"]["evil.pt"] = {"size": 9, "sha256": __import__("hashlib").sha256(b"\x80\x04pickle").hexdigest()}
    (newest / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"evil\.pt.*only \.safetensors, \.json and \.distcp"):
        store.load(20)
    assert store.latest_valid() == older


def test_resaving_a_step_replaces_it_and_keep_last_k_locally(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(1, {"s": small_state(1.0)}, {})
    store.save(1, {"s": small_state(1.5)}, {"v": 2})
    parts, meta = store.load(1)
    assert meta == {"v": 2} and parts["s"]["weights"]["w"][0, 0].item() == 1.5
    for step in (2, 3, 4):
        store.save(step, {"s": small_state(float(step))}, {})
    assert [p.name for p in store.list_valid()] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_bad_arguments_are_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="part name"):
        store.save(1, {"meta": small_state()}, {})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        store.save(1, {"s": small_state()}, {"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    assert not list(tmp_path.glob("step_*")) and not list(tmp_path.glob(".tmp-*"))


DEEP = b"[" * 100_000 + b"]" * 100_000  # json's parser recurses once per level: a RecursionError at ~1000


def plant(path, name: str, body: bytes) -> None:
    """Replace `name` in checkpoint `path` with `body` and fix its manifest entry up (size and sha256 match)."""
    (path / name).write_bytes(body)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, body, why", [
    ("meta.json", DEEP, r"not valid JSON \(nested deeper than 256 levels\)"),
    ("meta.json", b"[" * 300 + b"]" * 300, r"not valid JSON \(nested deeper than 256 levels\)"),  # parses, too deep
    ("meta.json", b"{not json", r"not valid JSON \(Expecting property name"),
    ("meta.json", b"[1, 2]", r"meta\.json is not a JSON object"),
    ("driver.json", DEEP, r"driver\.json is not valid JSON \(nested deeper"),
], ids=["deep-meta", "300-deep-meta", "garbage-meta", "list-meta", "deep-skeleton"])
def test_a_deep_or_garbage_json_with_a_matching_hash_is_a_damaged_checkpoint(tmp_path, caplog, name, body, why):
    """Issue 44, finding 9: a 100k-deep meta.json whose manifest entry was fixed up raised RecursionError out of
    `latest_valid`/`plan_resume`. It is damage: `verify_checkpoint` and `load` refuse it naming the file, and
    `latest_valid` passes over it to the older step with a warning."""
    store = CheckpointStore(tmp_path)
    older = store.save(1, {"driver": {"step": 1}}, {"config": {}})
    newest = store.save(2, {"driver": {"step": 2}}, {"config": {}})
    plant(newest, name, body)
    with pytest.raises(CheckpointError, match=why):
        verify_checkpoint(newest)
    with pytest.raises(CheckpointError, match=why):
        store.load(2)
    caplog.set_level(logging.WARNING, logger="posttrain.storage")
    assert store.latest_valid() == older and store.list_valid() == [older]
    assert f"ignoring checkpoint {newest}" in caplog.text and "passing over newer step 2" in caplog.text
    verify_checkpoint(newest, check_hashes=False)  # sizes only: a writer's own quick check stays quick


class MemoryS3:
    """The calls a restore makes of an S3 client (listing, get_object), over objects in a dict: no process."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    def get_paginator(self, _name):
        objects = self.objects

        class Pages:
            def paginate(self, Bucket, Prefix):  # boto3's keyword names
                return [{"Contents": [{"Key": k} for k in sorted(objects) if k.startswith(Prefix)]}]

        return Pages()

    def get_object(self, Bucket, Key, **_):
        return {"Body": io.BytesIO(self.objects[Key])}


def test_a_deep_s3_manifest_or_run_record_is_damage_not_a_recursion_error(tmp_path, caplog):
    """The same on S3: a remote step whose manifest.json is 100k deep is passed over (the local older step is
    restored, with a warning naming it), and a 100k-deep run.json reads as no record."""
    store = CheckpointStore(tmp_path, remote_uri="s3://bucket/run", s3_client=MemoryS3({
        "run/step_00000002/manifest.json": DEEP, "run/run.json": DEEP, "run/ok.json": b'{"run_id": "a"}'}))
    older = CheckpointStore(tmp_path).save(1, {"driver": {"step": 1}}, {})  # saved locally only
    with pytest.raises(CheckpointError, match=r"s3://bucket/run/step_00000002/manifest.json is not valid JSON "
                                              r"\(nested deeper than 256 levels\); the remote checkpoint"):
        store.download(2)
    caplog.set_level(logging.WARNING, logger="posttrain.storage")
    assert store.latest_valid() == older
    assert "passing over newer step 2 (remote copy damaged: s3://bucket/run/step_00000002/manifest.json" in caplog.text
    assert not list(tmp_path.glob(".tmp-*"))
    assert store.read_remote_json("run.json") is None and store.read_remote_json("ok.json") == {"run_id": "a"}


# ---------------------------------------------------------------------------------------- S3 (moto)

@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Dummy credentials in the environment, no AWS profile or config file, no endpoint yet."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
                 "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-access-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture
def s3(moto_server, aws_env, monkeypatch):
    """Environment pointing boto3 at moto (dummy credentials), and a fresh bucket: yields its name."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return bucket


def remote_keys(bucket, prefix="run"):
    client = boto3.client("s3")
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def failing_client(max_attempts: int, failures: int = 10**9):
    """A client as the store makes one (botocore's adaptive retries, `max_attempts` tries) whose first `failures`
    PutObject requests S3 answers with 503 SlowDown; returns (client, live request counts)."""
    client = s3_client(S3Config(max_attempts=max_attempts))
    return client, s3_error_answers(client, "PutObject", failures)


@pytest.mark.e2e
def test_s3_keep_last_k_remote_and_restore_after_local_root_deleted(s3, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    store = CheckpointStore(root, keep=2, remote_uri=f"s3://{s3}/run")
    model, opt = trained_adamw()
    saved = {}
    for step in (5, 10, 15):
        saved[step] = {"trainer_rank0": {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                         "step": step, "bf16": torch.randn(4, 4).to(torch.bfloat16)},
                       "driver": {"rng": np.random.get_state(), "cursor": step * 3}}
        store.save(step, saved[step], {"step": step})
    assert store.list_remote() == [10, 15]
    assert [p.name for p in store.list_valid()] == ["step_00000010", "step_00000015"]
    keys = remote_keys(s3)
    assert not [k for k in keys if "step_00000005" in k]
    assert f"run/step_00000015/{MANIFEST}" in keys and "run/step_00000015/trainer_rank0.safetensors" in keys

    shutil.rmtree(tmp_path / "run")
    fresh = CheckpointStore(root, keep=2, remote_uri=f"s3://{s3}/run")
    assert fresh.latest_valid(prefer_remote_if_local_missing=False) is None
    restored = fresh.latest_valid()
    assert restored == root / "step_00000015"
    verify_checkpoint(restored)
    parts, meta = fresh.load(restored)
    assert meta == {"step": 15}
    assert_same(saved[15], parts)


@pytest.mark.e2e
def test_s3_remote_checkpoint_with_bad_checksum_is_skipped_on_restore(s3, tmp_path):
    store = CheckpointStore(tmp_path / "a", keep=3, remote_uri=f"s3://{s3}/run")
    store.save(1, {"s": small_state(1.0)}, {})
    store.save(2, {"s": small_state(2.0)}, {})
    # replace a remote tensor file of step 2 with different bytes of the same size
    client = boto3.client("s3")
    key = "run/step_00000002/s.safetensors"
    body = bytearray(client.get_object(Bucket=s3, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=s3, Key=key, Body=bytes(body))
    fresh = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{s3}/run")
    assert fresh.latest_valid() == tmp_path / "b" / "step_00000001"
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["step_00000001"]  # nothing half-downloaded


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.e2e
def test_s3_truncated_newest_local_copy_is_restored_from_its_intact_remote_copy(s3, tmp_path, caplog):
    """The newest local checkpoint torn (a disk filled mid-copy): resume takes the same step from S3 rather than
    falling back to an older step whose next save would overwrite the intact remote copy."""
    store = CheckpointStore(tmp_path, keep=3, remote_uri=f"s3://{s3}/run")
    store.save(1, {"s": small_state(1.0)}, {})
    newest = store.save(2, {"s": small_state(2.0)}, {})
    truncate(newest / "s.safetensors")
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        assert store.latest_valid() == newest
    parts, _ = store.load(newest)
    assert torch.equal(parts["s"]["weights"]["w"], torch.full((3, 4), 2.0))
    assert store.list_remote() == [1, 2]
    # local only: the torn step is passed over, and the log says which step and why
    caplog.clear()
    truncate(newest / "s.safetensors")
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        assert store.latest_valid(prefer_remote_if_local_missing=False) == tmp_path / "step_00000001"
    assert "passing over newer step 2 (local copy damaged" in caplog.text


@pytest.mark.e2e
def test_s3_remote_newer_than_local_wins(s3, tmp_path):
    """A stale local directory (another machine went on and saved step 3 to S3): resume takes step 3."""
    a = CheckpointStore(tmp_path / "a", remote_uri=f"s3://{s3}/run")
    for step in (1, 2, 3):
        a.save(step, {"s": small_state(float(step))}, {})
    b = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{s3}/run")
    shutil.copytree(tmp_path / "a" / "step_00000001", tmp_path / "b" / "step_00000001")
    assert b.latest_valid() == tmp_path / "b" / "step_00000003"


@pytest.mark.e2e
def test_s3_unreachable_at_resume_never_falls_back_to_an_older_step(s3, tmp_path, monkeypatch):
    """The newest local copy torn and the endpoint down: resume fails naming the step and the endpoint, instead of
    resuming from step 1 (and later overwriting the intact step 2 on S3). Listing failures fail the same way."""
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run")
    store.save(1, {"s": small_state(1.0)}, {})
    newest = store.save(2, {"s": small_state(2.0)}, {})
    truncate(newest / "s.safetensors")

    class DownloadsFail:
        def __init__(self, client):
            self._client = client

        def download_file(self, *args, **kwargs):
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

        def __getattr__(self, name):
            return getattr(self._client, name)

    down = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", s3_client=DownloadsFail(boto3.client("s3")))
    with pytest.raises(CheckpointUnavailable, match=r"step 2 is on s3://.*could not be downloaded.*Not resuming from "
                                                    r"an older step"):
        down.latest_valid()
    assert not down._is_valid(newest)  # the torn copy was left as it was, not replaced by an older step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]  # no temp dir left

    unlisted = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", s3_config=S3Config(max_attempts=1),
                               endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CheckpointUnavailable, match="listing s3://.* failed"):
        unlisted.latest_valid()


@pytest.mark.e2e
def test_s3_step_missing_an_object_is_passed_over_with_a_warning(s3, tmp_path, caplog):
    a = CheckpointStore(tmp_path / "a", remote_uri=f"s3://{s3}/run")
    a.save(1, {"s": small_state(1.0)}, {})
    a.save(2, {"s": small_state(2.0)}, {})
    boto3.client("s3").delete_object(Bucket=s3, Key="run/step_00000002/s.safetensors")
    b = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{s3}/run")
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        assert b.latest_valid() == tmp_path / "b" / "step_00000001"
    assert "passing over newer step 2 (remote copy damaged" in caplog.text


@pytest.mark.e2e
def test_s3_failed_uploads_are_retried_and_succeed(s3, tmp_path):
    client, puts = failing_client(max_attempts=3, failures=2)
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", s3_client=client)
    path = store.save(3, {"s": small_state(3.0)}, {"k": 1})
    files = sorted(p.name for p in path.iterdir())
    assert puts == {"requests": len(files) + 2, "failed": 2}  # botocore sent the first file three times
    assert remote_keys(s3) == [f"run/step_00000003/{n}" for n in files]
    assert store.list_remote() == [3]


@pytest.mark.e2e
def test_s3_upload_that_keeps_failing_keeps_local_copies_and_hides_the_secret(s3, tmp_path, caplog):
    good = CheckpointStore(tmp_path, keep=1, remote_uri=f"s3://{s3}/run")
    first = good.save(1, {"s": small_state(1.0)}, {})
    client, puts = failing_client(max_attempts=3)
    store = CheckpointStore(tmp_path, keep=1, remote_uri=f"s3://{s3}/run", s3_client=client)
    with caplog.at_level(logging.DEBUG, logger="posttrain.storage"), pytest.raises(CheckpointUploadError) as info:
        store.save(2, {"s": small_state(2.0)}, {})
    err = info.value
    assert puts["requests"] == 3  # one file, tried max_attempts times, then given up
    assert "SlowDown" in str(err) and "local checkpoint is intact" in str(err)
    assert err.local_path == tmp_path / "step_00000002"
    text = str(err) + "".join(traceback.format_exception(err)) + caplog.text
    assert SECRET not in text
    # the new local checkpoint is complete and the older one was not pruned (keep=1)
    assert store.list_valid() == [first, tmp_path / "step_00000002"]
    assert store.list_remote() == [1]
    assert not [k for k in remote_keys(s3) if "step_00000002" in k and k.endswith(MANIFEST)]


class GatedUploads:
    """The real boto3 client whose upload_file waits for `gate` (an Event) before sending."""

    def __init__(self, client, gate):
        self._client, self.gate, self.uploaded = client, gate, []

    def upload_file(self, filename, bucket, key, **kwargs):
        assert self.gate.wait(60), "the test never opened the gate"
        self.uploaded.append(key)
        return self._client.upload_file(filename, bucket, key, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.e2e
def test_s3_background_upload_returns_at_once_supersedes_waiting_steps_and_keeps_busy_ones(s3, tmp_path):
    gate = threading.Event()
    client = GatedUploads(boto3.client("s3"), gate)
    store = CheckpointStore(tmp_path, keep=1, remote_uri=f"s3://{s3}/run", s3_client=client, background_upload=True)
    one = store.save(1, {"s": small_state(1.0)}, {})
    store.save(2, {"s": small_state(2.0)}, {})  # step 1 is uploading (held at the gate): step 2 waits
    three = store.save(3, {"s": small_state(3.0)}, {})  # supersedes step 2 before its upload started
    assert store.list_remote() == []  # every save returned with nothing uploaded yet
    assert one.is_dir() and not (tmp_path / "step_00000002").exists()  # keep=1, but step 1 is still uploading
    gate.set()
    store.flush()
    assert store.list_remote() == [3]  # step 1 was uploaded, then pruned remotely (keep=1) after step 3
    assert not [k for k in client.uploaded if "step_00000002" in k]
    restored = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{s3}/run").latest_valid()
    assert_same(CheckpointStore(tmp_path / "b").load(restored)[0], store.load(three)[0])


@pytest.mark.e2e
def test_s3_background_upload_failure_is_raised_by_flush_or_the_next_save(s3, tmp_path):
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", s3_client=failing_client(max_attempts=2)[0],
                            background_upload=True)
    first = store.save(1, {"s": small_state(1.0)}, {})
    with pytest.raises(CheckpointUploadError, match="SlowDown") as info:
        store.flush()
    assert info.value.local_path == first and store.list_valid() == [first]
    store.save(2, {"s": small_state(2.0)}, {})
    deadline = time.monotonic() + 30
    while store._uploader is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(CheckpointUploadError, match="SlowDown"):
        store.save(3, {"s": small_state(3.0)}, {})  # the failure of step 2's upload, before step 3 is written
    assert [p.name for p in store.list_valid()] == ["step_00000001", "step_00000002"]

    # a failure while a newer step waits: flush reports it instead of waiting for an upload that never starts
    gate = threading.Event()
    gated = CheckpointStore(tmp_path / "g", remote_uri=f"s3://{s3}/run", background_upload=True,
                            s3_client=GatedUploads(failing_client(max_attempts=1)[0], gate))
    gated.save(1, {"s": small_state(1.0)}, {})
    gated.save(2, {"s": small_state(2.0)}, {})
    gate.set()
    finished = threading.Event()
    threading.Thread(target=lambda: (pytest.raises(CheckpointUploadError, gated.flush), finished.set()),
                     daemon=True).start()
    assert finished.wait(30), "flush hung after a failed upload with a newer step waiting"
    # the failure was reported; a second flush (a run's clean-up) tries the step left waiting again, and returns
    gated._s3 = s3_client(S3Config())
    gated.flush()
    assert gated.list_remote() == [2]


class LosesObjectsOnce:
    """The real boto3 client; right after its first manifest upload every object of the step vanishes (an endpoint
    that lost its data while it was down)."""

    def __init__(self, client, bucket):
        self._client, self.bucket, self.lost = client, bucket, False

    def upload_file(self, filename, bucket, key, **kwargs):
        out = self._client.upload_file(filename, bucket, key, **kwargs)
        if key.endswith(MANIFEST) and not self.lost:
            self.lost = True
            for obj in self._client.list_objects_v2(Bucket=bucket).get("Contents", []):
                self._client.delete_object(Bucket=bucket, Key=obj["Key"])
        return out

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.e2e
def test_s3_objects_lost_mid_upload_are_uploaded_again(s3, tmp_path, caplog):
    client = LosesObjectsOnce(boto3.client("s3"), s3)
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", s3_client=client)
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        path = store.save(1, {"s": small_state(1.0)}, {})
    assert client.lost and "uploading step 1 again" in caplog.text
    assert remote_keys(s3) == [f"run/step_00000001/{p.name}" for p in sorted(path.iterdir())]
    restored = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{s3}/run").latest_valid()
    assert_same(CheckpointStore(tmp_path / "b").load(restored)[0], store.load(path)[0])


@pytest.mark.e2e
def test_s3_multipart_upload_of_a_large_file(s3, tmp_path):
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run", multipart_threshold=1 * MiB,
                            multipart_chunksize=5 * MiB)
    big = torch.arange(6 * MiB // 4, dtype=torch.float32)  # 6 MiB: two parts (5 + 1 MiB)
    path = store.save(7, {"weights": {"w": big}}, {})
    head = boto3.client("s3").head_object(Bucket=s3, Key="run/step_00000007/weights.safetensors")
    assert head["ContentLength"] == (path / "weights.safetensors").stat().st_size > 6 * MiB
    assert head["ETag"].strip('"').endswith("-2")  # a multipart ETag: md5-of-parts "-" part count
    shutil.rmtree(path)
    restored = CheckpointStore(tmp_path, remote_uri=f"s3://{s3}/run").latest_valid()
    assert torch.equal(CheckpointStore(tmp_path).load(restored)[0]["weights"]["w"], big)


# ------------------------------------------------------------------------- S3: errors botocore does not retry

def count_requests(client) -> list[str]:
    """The name of every request `client` sends (or would send), live: botocore's `before-send` event."""
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url) and None)
    return sent


@pytest.mark.e2e
def test_s3_invalid_request_fails_at_once(s3, tmp_path):
    """A bucket name botocore refuses (ParamValidationError): nothing sent, an error naming the URI and the fix."""
    store = CheckpointStore(tmp_path, remote_uri="s3://not!a!bucket/run")
    sent = count_requests(store.s3)
    start = time.monotonic()
    with pytest.raises(CheckpointUploadError) as info:
        store.save(1, {"s": small_state(1.0)}, {})
    assert time.monotonic() - start < 10
    assert sent == []
    message = str(info.value)
    assert "s3://not!a!bucket/run" in message and "ParamValidationError" in message
    assert "not retried" in message and "tracking.checkpoint_uri" in message
    assert store.list_valid() == [tmp_path / "step_00000001"]  # the local checkpoint stays


@pytest.mark.e2e
def test_s3_missing_bucket_fails_at_once(s3, tmp_path):
    """NoSuchBucket, from a plain call and wrapped by upload_file (S3UploadFailedError): one request each."""
    missing = f"{s3}-missing"
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{missing}/run")
    sent = count_requests(store.s3)
    with pytest.raises(CheckpointUploadError) as info:
        store.save(1, {"s": small_state(1.0)}, {})
    assert len(sent) == 1  # the first delete, refused; botocore did not retry it
    assert f"s3://{missing}/run" in str(info.value) and "NoSuchBucket" in str(info.value)
    assert "create it" in str(info.value)

    local = tmp_path / "step_00000001" / MANIFEST
    start = time.monotonic()
    with pytest.raises(S3Failure) as info:
        store._call("upload", lambda: store.s3.upload_file(str(local), missing, "run/x"))
    assert time.monotonic() - start < 10
    assert len(sent) == 2
    assert "S3UploadFailedError" in str(info.value) and "not retried" in str(info.value)


class OutageAtFirstUpload:
    """The real boto3 client; its first upload_file call starts the outage (`outage()`) before sending."""

    def __init__(self, client, outage):
        self._client, self._outage = client, outage

    def upload_file(self, *args, **kwargs):
        outage, self._outage = self._outage, None
        if outage is not None:
            outage()
        return self._client.upload_file(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.e2e
@pytest.mark.parametrize("when", ["before_save", "mid_upload"])
def test_s3_upload_rides_out_an_endpoint_restart(aws_env, monkeypatch, tmp_path, caplog, when):
    """moto stopped (by its own pid) and started again on the same port ~4 s later, either before a save
    starts or once the save is uploading its files: with the default `tracking.s3` (botocore's adaptive
    retries, no retry of the store's own) the checkpoint is uploaded and verified once the endpoint is back."""
    port, bucket = free_port(), f"ckpt-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "moto.log"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    servers = [start_moto(port, log, (bucket,))]
    problems: list[BaseException] = []
    threads: list[threading.Thread] = []

    def restart_later() -> None:
        time.sleep(4)
        try:
            servers.append(start_moto(port, log, (bucket,)))  # moto forgets everything: the bucket is recreated
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            problems.append(exc)

    def outage() -> None:
        stop_group(servers[0], servers[0].pid)
        assert not _accepts(port)
        threads.append(threading.Thread(target=restart_later))
        threads[-1].start()

    try:
        client = s3_client(S3Config())  # the store's own client, the defaults of tracking.s3
        store = CheckpointStore(tmp_path / "a", remote_uri=f"s3://{bucket}/run",
                                s3_client=OutageAtFirstUpload(client, outage) if when == "mid_upload" else client)
        if when == "before_save":
            store.save(1, {"s": small_state(1.0)}, {})
            assert store.list_remote() == [1]
            outage()
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
            path = store.save(2, {"s": small_state(2.0)}, {"k": 2})
        took = time.monotonic() - start
        for thread in threads:
            thread.join()
        assert threads and not problems, problems
        assert took >= 3.5  # it did wait for the endpoint
        retried = [r.getMessage() for r in caplog.records if " failed (EndpointConnectionError" in r.getMessage()]
        assert len(retried) >= 2 and all(f" of {S3Config().max_attempts} failed" in m for m in retried)
        if when == "mid_upload":
            assert all(m.startswith("S3 PutObject ") for m in retried)  # botocore retried the upload in progress
        assert store.list_remote() == [2]  # the restarted server holds step 2, complete and verified
        restored = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{bucket}/run").latest_valid()
        assert restored == tmp_path / "b" / "step_00000002"
        assert_same(CheckpointStore(tmp_path / "b").load(restored)[0], CheckpointStore(tmp_path / "a").load(path)[0])
    finally:
        for thread in threads:
            thread.join()
        for proc in servers:
            stop_group(proc, proc.pid)
