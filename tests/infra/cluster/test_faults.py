"""Faults injected into real runs, end to end: what survives, and what is lost (nothing beyond the bound).

* The S3 endpoint (moto's server, started here) stopped for 30 s mid-run: training goes on with local
  checkpoints, the uploads catch up once it is back, and the run ends with its last checkpoint on S3.
* The process writing a checkpoint killed (SIGKILL) in the middle of the write, locally and while
  uploading: no torn checkpoint is ever listed or loaded; the previous one is picked, and the next save
  clears the debris.
* The Prefect API server restarted mid-run (killed by its pid, started again on the same port and
  database): the flow run goes on and ends COMPLETED in the API.

A killed Ray actor (automatic restart) and a killed `posttrain run` (exact resume) are in test_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest

from infra.checkpoints.store import MANIFEST, CheckpointStore, checkpoint_step
from infra.processes import free_port
from infra.services.prefect_api import http_ok
from infra.services.supervisor import venv_bin
from tests.builders import STARTUP_TIMEOUT_S
from tests.conftest import REPO, recipe
from tests.run_helpers import MATH, read_metrics, run_flow
from tests.servers import _started, start_moto, stop_group

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
OUTAGE_S = 30.0


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """Dummy credentials, no profile: the retries are botocore's, as `tracking.s3` sets them (the defaults)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


# ------------------------------------------------------------------------------ S3 down for 30 s

def test_training_continues_through_a_30s_s3_outage_and_the_upload_catches_up(cwd, aws, monkeypatch, tmp_path):
    port, bucket = free_port(), f"outage-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    log = tmp_path / "moto.log"
    servers = [start_moto(port, log, (bucket,))]
    run_dir = cwd / "runs" / "outage"
    seen: dict = {}

    def outage() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any(r.get("step") == 2 for r in read_metrics(run_dir)):
            time.sleep(0.1)
        stop_group(servers[0], servers[0].pid)
        seen["down"] = time.monotonic()
        time.sleep(OUTAGE_S)
        seen["steps_while_down"] = [r["step"] for r in read_metrics(run_dir) if r["step"] > 2]
        servers.append(start_moto(port, log, (bucket,)))  # moto kept nothing: an empty bucket comes back
        seen["up"] = time.monotonic()

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    try:
        result = run_flow("job.name=outage", "rl.max_steps=6", "rl.save_every=1", "rl.validation.every_steps=0",
                          "rl.validation.before_training=false", f"tracking.checkpoint_uri=s3://{bucket}/ckpt")
        finished = time.monotonic()
        thread.join(timeout=120)
        assert result["step"] == 6 and "up" in seen
        # training went on without S3: the steps after the outage began were trained and logged while it lasted
        assert seen["steps_while_down"] == [3, 4, 5, 6]
        assert finished >= seen["up"]  # the run waited for its uploads before reporting done
        run_id = json.loads((run_dir / "run_state.json").read_text())["run_id"]  # <uri>/<job.name>/<run id>
        store = CheckpointStore(tmp_path / "fresh", remote_uri=f"s3://{bucket}/ckpt/outage/{run_id}")
        assert store.list_remote()[-1] == 6  # the last checkpoint reached S3 after the endpoint came back
        restored = store.latest_valid()
        local = CheckpointStore(run_dir / "checkpoints").path_for(6)
        assert (restored / MANIFEST).read_bytes() == (local / MANIFEST).read_bytes()  # same files, same hashes
    finally:
        thread.join(timeout=120)
        for proc in servers:
            stop_group(proc, proc.pid)


# ------------------------------------------------------------------------------ killed mid-write

WRITER = """
import sys, torch
from infra.checkpoints.store import CheckpointStore
root, remote = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
store = CheckpointStore(root, keep=10, remote_uri=remote, multipart_threshold=8 * 2**20, multipart_chunksize=8 * 2**20)
for step in range(1, 1000):
    big = torch.full((48 * 2**20 // 4,), float(step))  # 48 MiB per part: a write takes a visible while
    store.save(step, {"a": {"w": big}, "b": {"w": big.clone(), "step": step}}, {"step": step})
    print("saved", step, flush=True)
"""


def start_writer(root: Path, *remote: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), *remote], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_when(proc: subprocess.Popen, condition, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the writer exited early: {proc.stdout.read()[-2000:]}"
        assert time.monotonic() < deadline, "the kill point was never reached"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def assert_only_whole_checkpoints(store: CheckpointStore) -> int:
    """Every listed checkpoint loads and holds its own step; returns the newest step."""
    valid = store.list_valid()
    assert valid, "no checkpoint survived"
    for path in valid:
        parts, meta = store.load(path)
        step = checkpoint_step(path)
        assert meta == {"step": step} and parts["b"]["step"] == step
        assert float(parts["a"]["w"][-1]) == float(step) == float(parts["b"]["w"][0])
    return checkpoint_step(valid[-1])


def test_a_process_killed_while_writing_a_checkpoint_never_leaves_a_torn_one(tmp_path):
    root = tmp_path / "ckpt"
    writer = start_writer(root)
    # killed with step 2 half written: its temporary directory holds a partial tensor file
    kill_when(writer, lambda: any(p.name.startswith(".tmp-step_00000002") and any(p.glob("*.safetensors"))
                                  for p in root.glob(".tmp-*")))
    assert list(root.glob(".tmp-step_00000002*")), "the kill did not land inside the write"
    store = CheckpointStore(root)
    assert assert_only_whole_checkpoints(store) == 1 and store.latest_valid() == root / "step_00000001"
    store.save(2, {"a": {"w": store.load(1)[0]["a"]["w"]}, "b": {"w": store.load(1)[0]["b"]["w"], "step": 2}},
               {"step": 2})
    assert not list(root.glob(".tmp-*"))  # the next save clears the debris


def test_a_process_killed_while_uploading_never_leaves_a_remote_step_that_looks_complete(aws, monkeypatch, tmp_path):
    port, bucket = free_port(), f"torn-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    moto = start_moto(port, tmp_path / "moto.log", (bucket,))
    try:
        client = boto3.client("s3")

        def keys() -> list[str]:
            return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", [])]

        writer = start_writer(tmp_path / "a", f"s3://{bucket}/run")
        # killed once step 2 has objects on S3 but not yet its manifest (written last)
        kill_when(writer, lambda: any("step_00000002/" in k for k in keys()))
        step2 = [k for k in keys() if "step_00000002/" in k]
        assert step2 and f"run/step_00000002/{MANIFEST}" not in step2, step2
        fresh = CheckpointStore(tmp_path / "b", remote_uri=f"s3://{bucket}/run")
        assert fresh.list_remote() == [1]
        assert checkpoint_step(fresh.latest_valid()) == 1
        assert assert_only_whole_checkpoints(CheckpointStore(tmp_path / "b")) == 1
    finally:
        stop_group(moto, moto.pid)


# ------------------------------------------------------------------------------ Prefect API restarted

def start_prefect(port: int, home: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_UI_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING")
    with open(log, "ab") as out:
        proc = subprocess.Popen([venv_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _started(proc, lambda: http_ok(f"http://127.0.0.1:{port}/api/health"), 240, "prefect server", log)
    except BaseException:
        stop_group(proc, proc.pid)
        raise
    return proc


STEPS = 40  # ~0.3 s each here: the run outlasts the outage


def test_a_run_survives_a_prefect_api_restart(cwd, tmp_path):
    import asyncio

    from prefect.client.orchestration import PrefectClient

    port, home = free_port(), tmp_path / "prefect-home"
    api = f"http://127.0.0.1:{port}/api"
    servers = [start_prefect(port, home, tmp_path / "prefect.log")]
    run_dir = cwd / "runs" / "api-restart"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in ("RAY_ADDRESS",
                                                                                            "MLFLOW_TRACKING_URI")}
    env.update(PREFECT_API_URL=api, PREFECT_HOME=str(tmp_path / "client-home"), DO_NOT_TRACK="1",
               RAY_USAGE_STATS_ENABLED="0", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=str(STARTUP_TIMEOUT_S))
    overrides = [*MATH, "job.name=api-restart", f"rl.max_steps={STEPS}", "rl.save_every=10", "rl.validation.every_steps=0",
                 "rl.validation.before_training=false"]
    run_log, run = tmp_path / "run.log", None
    try:
        with open(run_log, "wb") as out:
            run = subprocess.Popen([str(Path(sys.executable).parent / "posttrain"), "run", recipe("arithmetic"), "--",
                                    *overrides], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline = time.monotonic() + 600
        while not any(r.get("step") == 2 for r in read_metrics(run_dir)):
            assert run.poll() is None, run_log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.1)
        stop_group(servers[0], servers[0].pid)  # the API goes away mid-run ...
        time.sleep(3)
        down_steps = [r["step"] for r in read_metrics(run_dir)]
        servers.append(start_prefect(port, home, tmp_path / "prefect.log"))  # ... and comes back, same database
        assert run.wait(timeout=600) == 0, run_log.read_text()[-6000:]
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
        assert max(down_steps) < STEPS  # the API came back before the run ended: the restart was mid-run

        async def final_state():
            async with PrefectClient(api=api) as client:
                runs = await client.read_flow_runs()
                return [(r.name, r.state.type.value) for r in runs]

        states = asyncio.run(final_state())
        assert len(states) == 1 and states[0][1] == "COMPLETED", states
        assert json.loads((run_dir / "run_state.json").read_text())["mlflow_run_id"]
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for proc in servers:
            stop_group(proc, proc.pid)
