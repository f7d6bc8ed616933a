"""The final model and the run directory on a cluster: every trainer rank must see the driver's run directory.

- `CheckpointStore.upload_dir` / `download_dir` against moto's S3 server: a model directory (subdirectories,
  files of any kind) round-trips byte for byte; a re-upload leaves no stale object; a damaged object is refused.
- A `Cluster` in a process of its own (its local Ray inherits the moto settings, as a node's raylet would have
  them): its placement probe finds that the ranks see the run directory (one machine); rank 0 writes the final
  model there and the driver mirrors it to `<checkpoint_uri>/final_model/`.
- The refusal of ranks that do not see the run directory names their nodes, the run directory and the fix. One
  machine cannot give a rank a filesystem of its own, so the refusal is checked through its message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.checkpoints.store import CheckpointError, CheckpointStore
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


@pytest.mark.e2e
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


def test_the_refusal_names_the_nodes_the_run_directory_and_the_fix():
    from infra.cluster.cluster import shards_unreachable

    message = shards_unreachable(Path("/runs/r"), [{"ip": "10.0.0.2"}, {"ip": "10.0.0.3"}], "10.0.0.1")
    assert "trainer ranks on 10.0.0.2, 10.0.0.3" in message and "driver on node 10.0.0.1" in message
    assert "/runs/r" in message and "job.out_dir" in message


DRIVER = """
import json, sys
from pathlib import Path
from infra.cluster.cluster import Cluster
from infra.checkpoints.store import CheckpointStore
from rl_core.config import load_config

cfg = load_config(sys.argv[1], sys.argv[3:])
run_dir = Path(cfg.run_dir)
run_dir.mkdir(parents=True)
with Cluster(cfg, with_engines=False) as cluster:
    seen = cluster.ranks_see_run_dir
    out = cluster.save_pretrained(run_dir / "final_model", CheckpointStore(run_dir / "checkpoints", remote_uri=sys.argv[2]))
print(json.dumps({"seen": seen, "out": out}))
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_the_final_model_is_written_by_rank_0_into_the_run_directory_and_mirrored_to_s3(workdir, bucket, tmp_path):
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
    assert result == {"seen": True, "out": str(final)}  # the placement probe: the ranks see the run directory
    local = read_tree(final)
    assert any(name.endswith(".safetensors") for name in local) and "config.json" in local
    s3 = boto3.client("s3")
    for name, data in local.items():  # the S3 copy is the run directory's, byte for byte
        assert s3.get_object(Bucket=bucket, Key=f"job/run/final_model/{name}")["Body"].read() == data
    listing = json.loads(s3.get_object(Bucket=bucket, Key="job/run/final_model/manifest.json")["Body"].read())
    assert set(listing["files"]) == set(local)
