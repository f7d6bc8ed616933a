"""The final model on a cluster of several nodes: through `tracking.checkpoint_uri` when trainer rank 0 does not see
the driver's run directory, refused at placement when there is no checkpoint_uri.

- `CheckpointStore.upload_dir` / `download_dir` against moto's S3 server: a model directory (subdirectories,
  files of any kind) round-trips byte for byte; a re-upload leaves no stale object; a damaged object is refused.
- A `Cluster` in a process of its own (its local Ray inherits the moto settings, as a node's raylet would have
  them): its placement probe finds that rank 0 sees the run directory (one machine); told otherwise, as for a rank 0
  on another node, rank 0 uploads the model and the driver's `final_model/` is what it downloads.
- The refusal's message names `tracking.checkpoint_uri`, both nodes and the run directory. One machine cannot give
  rank 0 a filesystem of its own, so the refusal itself is checked through the message it raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.storage import CheckpointError, CheckpointStore
from tests.conftest import FAST, REPO, recipe


def model_like_dir(root: Path) -> dict[str, bytes]:
    files = {"model.safetensors": os.urandom(3000), "config.json": b'{"a": 1}', "chat_template.jinja": b"{{ x }}",
             "adapter/adapter_model.safetensors": os.urandom(500), "adapter/adapter_config.json": b"{}"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in root.rglob("*") if f.is_file()}


def test_upload_dir_and_download_dir_round_trip_a_model_directory(bucket, tmp_path):
    import boto3

    store = CheckpointStore(tmp_path / "checkpoints", remote_uri=f"s3://{bucket}/job/run")
    files = model_like_dir(tmp_path / "model")
    assert store.upload_dir(tmp_path / "model", "final_model") == f"s3://{bucket}/job/run/final_model"
    dest = tmp_path / "driver" / "final_model"
    dest.mkdir(parents=True)
    (dest / "stale.json").write_text("{}")  # replaced, not merged
    store.download_dir("final_model", dest)
    assert read_tree(dest) == files
    assert store.list_remote() == []  # not a checkpoint step

    (tmp_path / "model" / "chat_template.jinja").unlink()  # a second upload of the name replaces the first
    store.upload_dir(tmp_path / "model", "final_model")
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="job/run/")["Contents"]}
    assert keys == {f"job/run/final_model/{n}" for n in [*files, "manifest.json"] if n != "chat_template.jinja"}

    boto3.client("s3").put_object(Bucket=bucket, Key="job/run/final_model/config.json", Body=b'{"a": 2}')
    with pytest.raises(CheckpointError, match="config.json does not match its size and sha256"):
        store.download_dir("final_model", tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_the_refusal_names_checkpoint_uri_the_nodes_and_the_run_directory():
    from infra.cluster import final_model_unreachable

    message = final_model_unreachable(Path("/runs/r"), {"ip": "10.0.0.2", "node_id": "abc"}, "10.0.0.1")
    assert "tracking.checkpoint_uri" in message and "/runs/r" in message
    assert "node 10.0.0.2 (node id abc)" in message and "driver on node 10.0.0.1" in message


DRIVER = """
import json, sys
from pathlib import Path
from infra.cluster import Cluster
from infra.storage import CheckpointStore
from rl_core.config import load_config

cfg = load_config(sys.argv[1], sys.argv[3:])
run_dir = Path(cfg.run_dir)
run_dir.mkdir(parents=True)
with Cluster(cfg, with_engines=False) as cluster:
    seen = cluster.rank0_sees_run_dir
    cluster.rank0_sees_run_dir = False  # as the probe finds for a rank 0 on another node
    out = cluster.save_pretrained(run_dir / "final_model", CheckpointStore(run_dir / "checkpoints", remote_uri=sys.argv[2]))
print(json.dumps({"seen": seen, "out": out}))
"""


@pytest.mark.slow
def test_a_rank0_that_does_not_see_the_run_directory_sends_the_final_model_through_s3(workdir, bucket, tmp_path):
    import boto3

    model = workdir / "artifacts" / "tiny-model" / "init"
    overrides = [*FAST, f"model.name_or_path={model}", f"job.out_dir={tmp_path / 'runs'}", "job.name=far"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", DRIVER, recipe("arithmetic"), f"s3://{bucket}/job/run", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    final = tmp_path / "runs" / "far" / "final_model"
    assert result == {"seen": True, "out": str(final)}
    local = read_tree(final)
    assert any(name.endswith(".safetensors") for name in local) and "config.json" in local
    s3 = boto3.client("s3")
    for name, data in local.items():  # what the driver has is what rank 0 uploaded
        assert s3.get_object(Bucket=bucket, Key=f"job/run/final_model/{name}")["Body"].read() == data
    listing = json.loads(s3.get_object(Bucket=bucket, Key="job/run/final_model/manifest.json")["Body"].read())
    assert set(listing["files"]) == set(local)
