"""S3 through boto3's own machinery: botocore's adaptive retries with the budget of `tracking.s3`, and SHA256
checksums that S3 checks and stores on upload and botocore checks on download.

Against moto's S3 server on 127.0.0.1 (the `bucket` fixture: one server per module, started and stopped by its pid).
Faults go into the real client through botocore's events (`tests/faults.py`): S3 error answers that botocore's retry
handler meets as it would meet S3's, and bodies corrupted on the way back under S3's own checksum header.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path

import boto3
import pytest
import torch

from infra.checkpoints.format import MANIFEST
from infra.checkpoints.store import CheckpointError, CheckpointStore, CheckpointUploadError
from rl_core.config import ConfigError, PosttrainConfig, S3Config, config_from_dict
from tests.faults import s3_corrupted_bodies, s3_error_answers

MiB = 1024 * 1024


def state(value: float, n: int = 12) -> dict:
    return {"weights": {"w": torch.full((n,), value)}, "counters": {"step": int(value)}}


def sha256_b64(data: bytes) -> str:
    """S3's ChecksumSHA256 of `data`, computed here: base64 of the raw SHA256 digest."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


# ------------------------------------------------------------------------------ retries: botocore's, configured

def test_tracking_s3_sets_botocore_adaptive_retries_and_timeouts(monkeypatch, tmp_path):
    """`tracking.s3` reaches the client the store makes: adaptive mode, max_attempts as the total number of tries,
    the timeouts; AWS_MAX_ATTEMPTS / AWS_RETRY_MODE do not override it. Out of range values are refused by key."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")
    defaults = PosttrainConfig().model_dump()
    cfg = config_from_dict(defaults, ["tracking.s3.max_attempts=7", "tracking.s3.connect_timeout_s=2.5",
                                      "tracking.s3.read_timeout_s=30.0"])
    client = CheckpointStore(tmp_path, remote_uri="s3://bkt/run", s3_config=cfg.tracking.s3).s3
    assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 7}
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (2.5, 30.0)
    # no config given: the schema's default, the one owner of it
    default = CheckpointStore(tmp_path, remote_uri="s3://bkt/run").s3.meta.config.retries
    assert default == {"mode": "adaptive", "total_max_attempts": PosttrainConfig().tracking.s3.max_attempts}
    for bad in ("tracking.s3.max_attempts=0", "tracking.s3.read_timeout_s=0.0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            config_from_dict(defaults, [bad])


@pytest.mark.e2e
def test_s3_throttling_is_retried_by_botocore_and_logged(bucket, tmp_path, caplog):
    """S3 answers the first two PutObject requests 503 SlowDown: botocore sends the file again (no retry loop of
    ours), each failed try is logged with its number, and the checkpoint ends up on S3 complete."""
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{bucket}/run", s3_config=S3Config(max_attempts=3))
    puts = s3_error_answers(store.s3, "PutObject", 2)
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        path = store.save(1, {"s": state(1.0)}, {})
    assert puts == {"requests": len(list(path.iterdir())) + 2, "failed": 2}
    tries = [r.getMessage() for r in caplog.records if "PutObject" in r.getMessage()]
    assert [t.split(": try ")[1] for t in tries] == ["1 of 3 failed (HTTP 503 SlowDown)",
                                                    "2 of 3 failed (HTTP 503 SlowDown)"]
    assert store.list_remote() == [1]


@pytest.mark.e2e
@pytest.mark.parametrize("code, status, retried", [
    ("SlowDown", 503, True), ("InternalError", 500, True), ("RequestTimeout", 400, True),
    ("AccessDenied", 403, False), ("NoSuchBucket", 404, False),
])
def test_s3_which_errors_botocore_retries_up_to_max_attempts(bucket, tmp_path, code, status, retried):
    """An S3 error on every PutObject: transient ones are sent max_attempts times, then the upload fails saying so;
    the ones that name a fix are sent once, and the error says what to fix. The local checkpoint stays."""
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{bucket}/run", s3_config=S3Config(max_attempts=3))
    puts = s3_error_answers(store.s3, "PutObject", 10**9, code=code, status=status)
    with pytest.raises(CheckpointUploadError) as info:
        store.save(1, {"s": state(1.0)}, {})
    message = str(info.value)
    assert code in message and "local checkpoint is intact" in message
    if retried:
        assert puts["requests"] == 3
        assert "still failing after 3 tries (botocore's adaptive retries, tracking.s3.max_attempts=3)" in message
    else:
        assert puts["requests"] == 1
        assert "not retried" in message
    assert store.list_valid() == [tmp_path / "step_00000001"]


# ------------------------------------------------------------------------------ checksums: S3's, of the bytes

@pytest.mark.e2e
def test_s3_stores_the_sha256_of_every_uploaded_byte(bucket, tmp_path):
    """Every object of a checkpoint carries the SHA256 checksum S3 checked on upload: for one PUT the file's
    SHA256, for a multipart upload (6 MiB in parts of 5 MiB) the SHA256 of the parts' digests, "-2"; both equal
    what this test computes from the local bytes. No checksum is kept in the object's metadata."""
    store = CheckpointStore(tmp_path, remote_uri=f"s3://{bucket}/run", multipart_threshold=1 * MiB,
                            multipart_chunksize=5 * MiB)
    big = torch.arange(6 * MiB // 4, dtype=torch.float32)
    path = store.save(3, {"small": state(3.0), "big": {"w": big}}, {"k": 3})
    client = boto3.client("s3")
    for file in sorted(path.iterdir()):
        data = file.read_bytes()
        head = client.head_object(Bucket=bucket, Key=f"run/step_00000003/{file.name}", ChecksumMode="ENABLED")
        stored = head["ChecksumSHA256"]
        if len(data) >= 1 * MiB:
            parts = [data[:5 * MiB], data[5 * MiB:]]
            composite = sha256_b64(b"".join(hashlib.sha256(p).digest() for p in parts))
            assert stored.partition("-")[0] == composite and stored.partition("-")[2] in ("2", ""), file.name
        else:
            assert stored == sha256_b64(data), file.name
        assert "sha256" not in head.get("Metadata", {})
    assert {f.name for f in path.iterdir()} >= {"big.safetensors", "small.safetensors", MANIFEST}


class OverwritesOnce:
    """The store's client; after the first upload of `name` the object is replaced by other bytes of the same size
    that still carry the metadata tag `sha256=<the file's sha256>`: an object that is wrong while its tag is right."""

    def __init__(self, client, name):
        self._client, self.name, self.done = client, name, False

    def upload_file(self, filename, bucket, key, **kwargs):
        out = self._client.upload_file(filename, bucket, key, **kwargs)
        if key.endswith("/" + self.name) and not self.done:
            self.done = True
            data = Path(filename).read_bytes()
            bad = bytes(data[:-1]) + bytes([data[-1] ^ 0xFF])
            self._client.put_object(Bucket=bucket, Key=key, Body=bad,
                                    Metadata={"sha256": hashlib.sha256(data).hexdigest()})
        return out

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.e2e
def test_s3_upload_verification_checks_the_bytes_not_a_tag(bucket, tmp_path, caplog):
    """An uploaded object replaced by wrong bytes under the right metadata tag: S3's checksum of the object differs
    from the local file's, so the step is uploaded again, and S3 ends up holding the local bytes."""
    store = CheckpointStore(tmp_path / "a", remote_uri=f"s3://{bucket}/run")
    client = OverwritesOnce(store.s3, "s.safetensors")
    store._s3 = client
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        path = store.save(1, {"s": state(1.0)}, {})
    assert client.done
    assert "verify s3://" in caplog.text and "s.safetensors" in caplog.text and "uploading step 1 again" in caplog.text
    remote = boto3.client("s3").get_object(Bucket=bucket, Key="run/step_00000001/s.safetensors")["Body"].read()
    assert remote == (path / "s.safetensors").read_bytes()


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["s.safetensors", MANIFEST])
def test_s3_download_corrupted_in_transit_is_refused_naming_the_file(bucket, tmp_path, caplog, name):
    """Step 2's `name` comes back from S3 with a byte flipped under S3's own SHA256 header: botocore's check
    (ChecksumMode) refuses it, the error names the object, nothing half-downloaded is left, and a resume passes
    over step 2 as damaged (to step 1) rather than taking the bytes or stopping as if S3 were down."""
    a = CheckpointStore(tmp_path / "a", remote_uri=f"s3://{bucket}/run")
    a.save(1, {"s": state(1.0)}, {})
    a.save(2, {"s": state(2.0)}, {})
    b = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{bucket}/run")
    corrupted = s3_corrupted_bodies(b.s3, f"step_00000002/{name}")
    with pytest.raises(CheckpointError) as info:
        b.download(2)
    assert corrupted, "the corrupting hook never saw the download"
    assert f"s3://{bucket}/run/step_00000002/{name}" in str(info.value)
    assert "FlexibleChecksumError" in str(info.value) and "SHA256 checksum" in str(info.value)
    assert not (tmp_path / "b").exists() or list((tmp_path / "b").iterdir()) == []
    with caplog.at_level(logging.WARNING, logger="posttrain.storage"):
        assert b.latest_valid() == tmp_path / "b" / "step_00000001"
    assert "passing over newer step 2 (remote copy damaged" in caplog.text


@pytest.mark.e2e
def test_s3_directory_download_corrupted_in_transit_is_refused_naming_the_file(bucket, tmp_path):
    """The same for a directory carried beside the checkpoints (the final model): `download_dir` refuses it, naming
    the file, and `dest` is not created."""
    model = tmp_path / "final_model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    store = CheckpointStore(tmp_path / "ckpt", remote_uri=f"s3://{bucket}/run")
    store.upload_dir(model, "final_model")
    s3_corrupted_bodies(store.s3, "final_model/model.safetensors")
    with pytest.raises(CheckpointError, match=r"final_model/model\.safetensors: FlexibleChecksumError"):
        store.download_dir("final_model", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()
