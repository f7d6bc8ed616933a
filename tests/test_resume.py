"""Checkpoints and resume of the GRPO flow, end to end: real Prefect, real local Ray, MLflow on SQLite.

* resume policies (`rl.resume=auto|must|off`, `job.overwrite`, refused math keys, allowed cadence keys),
  first against `plan_resume` directly, then through the flow;
* a corrupted newest checkpoint is skipped, never loaded;
* checkpoints mirrored to S3 (moto's server on 127.0.0.1, started and stopped here) and a resume
  restored from S3 after the local checkpoint directory is deleted;
* exact resume after a real SIGKILL of the `posttrain run` process (slow): N steps straight equal
  k steps + kill + resume, in every metrics.jsonl value, at a checkpoint boundary, between
  checkpoints and before the first checkpoint.

The tiny model is random-init (its arithmetic reward is always 0), so the runs here add a KL anchor
to a *different* random-init reference model and a learning-rate warmup: every step then has a
non-zero loss and gradient and a step-dependent learning rate, so weights, optimizer, scheduler and
RNG states all have to be restored exactly for the trajectories to agree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import FAST, make_cwd, recipe

VENV_BIN = Path(sys.executable).parent
# non-zero gradients on the random-init model (KL to another random init) and a per-step lr (warmup)
MATH = [*FAST, "rl.kl_beta=0.1", "rl.reference=artifacts/tiny-model/ref", "rl.optimizer.lr=1e-3",
        "rl.optimizer.warmup_steps=8"]


# ------------------------------------------------------------------------------------------ helpers

# the ephemeral Prefect API server may take longer than its default 20 s to start on a loaded machine
STARTUP_TIMEOUT_S = "180"


def run_flow(*overrides: str) -> dict:
    """The flow in-process (cwd is the working directory), with the MATH overrides first."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.grpo import grpo

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: int(STARTUP_TIMEOUT_S)}):
        return grpo(recipe("arithmetic"), [*MATH, *overrides])


def read_metrics(run_dir: Path) -> list[dict]:
    """Complete lines only (a writer may be mid-line while a test polls)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]


def math_view(records: list[dict]) -> list[dict]:
    """Every value except timings (perf/*), which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def assert_same_math(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(math_view(got), math_view(want)):
        assert sorted(g) == sorted(w), f"step {w['step']}: keys differ: {sorted(set(g) ^ set(w))}"
        diff = {k: (g[k], w[k]) for k in w if g[k] != w[k]}  # ==: bitwise for the floats JSON round-trips
        assert not diff, f"step {w['step']}: values differ (resumed, straight): {diff}"


def mlflow_client(cwd: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri="sqlite:///" + str(cwd.resolve() / "mlflow.db"))


def artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out.extend(artifact_paths(client, run_id, f.path) if f.is_dir else [f.path])
    return out


def provenance(client, run_id: str, attempt: int, dst: Path) -> dict:
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(run_id=run_id, artifact_path=f"provenance/attempt_{attempt}.json",
                               dst_path=str(dst), tracking_uri=client._tracking_client.tracking_uri)
    return json.loads(Path(local).read_text())


def checkpoint_steps(run_dir: Path) -> list[int]:
    from infra.storage import CheckpointStore, checkpoint_step

    return [checkpoint_step(p) for p in CheckpointStore(run_dir / "checkpoints").list_valid()]


def run_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


# --------------------------------------------------------------------------- plan_resume, directly

def _cfg(*overrides: str):
    from rl_core.config import load_config

    return load_config(recipe("arithmetic"), [*MATH, "job.name=plan", *overrides])


def _save(store, cfg, step: int, run_id: str = "run-abc") -> None:
    import torch

    from infra.resume import checkpoint_meta

    store.save(step, {"trainer": {"w": torch.full((2, 3), float(step))}, "driver": {"step": step}},
               checkpoint_meta(cfg, mlflow_run_id=run_id))


def test_plan_resume_policies(tmp_path, monkeypatch):
    from infra.resume import plan_resume, write_run_state
    from infra.storage import CheckpointStore
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    cfg = _cfg()
    run_dir = Path(cfg.run_dir)
    store = CheckpointStore(run_dir / "checkpoints", keep=3)

    # nothing there: auto starts at 0, must refuses naming the setting
    assert plan_resume(cfg, store).checkpoint is None and plan_resume(cfg, store).start_step == 0
    with pytest.raises(ConfigError, match=r"rl\.resume=must"):
        plan_resume(_cfg("rl.resume=must"), store)

    for step in (2, 4):
        _save(store, cfg, step)
    write_run_state(run_dir, {"mlflow_run_id": "run-abc", "config_hash": "x"})
    plan = plan_resume(_cfg("rl.resume=must"), store)
    assert plan.start_step == 4 and plan.checkpoint == store.path_for(4)
    assert plan.parts["driver"] == {"step": 4} and plan.run_state["mlflow_run_id"] == "run-abc"
    assert float(plan.parts["trainer"]["w"][0, 0]) == 4.0

    # cadence / logging keys may change
    allowed = _cfg("rl.max_steps=999", "rl.save_every=7", "rl.validation.every_steps=3",
                   "rl.validation.max_prompts=5", "tracking.keep_checkpoints=1", "job.task_retries=0")
    assert plan_resume(allowed, store).start_step == 4
    # math keys may not; each changed key is named
    with pytest.raises(ConfigError) as info:
        plan_resume(_cfg("rl.optimizer.lr=2e-3", "job.seed=5"), store)
    assert "rl.optimizer.lr" in str(info.value) and "job.seed" in str(info.value)
    assert "rl.max_steps" not in str(info.value)
    for key in ("rl.kl_beta=0.2", "rollout.n=2", "data.train=data/arithmetic/val.jsonl",
                "model.name_or_path=artifacts/tiny-model/ref", "cluster.num_workers=2"):
        with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")):
            plan_resume(_cfg(key), store)

    # the newest checkpoint corrupted: skipped, the previous one is used
    part = store.path_for(4) / "trainer.safetensors"
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    assert plan_resume(cfg, store).start_step == 2

    # run_state.json gone (e.g. a fresh machine): the MLflow run id comes from the checkpoint meta
    (run_dir / "run_state.json").unlink()
    assert plan_resume(cfg, store).run_state == {"mlflow_run_id": "run-abc"}

    # off: refuses an existing run directory naming job.overwrite; with it, deletes the directory
    with pytest.raises(ConfigError, match=r"job\.overwrite=true"):
        plan_resume(_cfg("rl.resume=off"), store)
    assert store.path_for(2).is_dir()
    plan = plan_resume(_cfg("rl.resume=off", "job.overwrite=true"), store)
    assert plan.checkpoint is None and plan.run_state == {} and not run_dir.exists()


# ------------------------------------------------------------------------- policies through the flow

def test_flow_resume_policies(cwd, tmp_path):
    from rl_core.config import ConfigError

    client = mlflow_client(cwd)
    run_dir = cwd / "runs" / "pol"
    first = run_flow("job.name=pol", "rl.max_steps=4", "rl.save_every=2")
    before = (run_dir / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert checkpoint_steps(run_dir) == [2, 4]
    run_id = first["mlflow_run_id"]
    assert run_state(run_dir)["mlflow_run_id"] == run_id

    # must without any checkpoint (another job.name): fails naming the setting, trains nothing
    with pytest.raises(ConfigError, match=r"rl\.resume=must"):
        run_flow("job.name=pol-none", "rl.max_steps=2", "rl.resume=must")
    assert not (cwd / "runs" / "pol-none" / "metrics.jsonl").exists()
    assert not (cwd / "runs" / "pol-none" / "checkpoints").exists()

    # a math key changed: refused naming it, the run directory untouched
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.lr") as info:
        run_flow("job.name=pol", "rl.max_steps=6", "rl.optimizer.lr=2e-3")
    assert "rl.max_steps" not in str(info.value)
    assert (run_dir / "metrics.jsonl").read_bytes() == before and checkpoint_steps(run_dir) == [2, 4]

    # off on the existing directory: refused naming job.overwrite, untouched
    with pytest.raises(ConfigError, match=r"job\.overwrite"):
        run_flow("job.name=pol", "rl.max_steps=4", "rl.save_every=2", "rl.resume=off")
    assert (run_dir / "metrics.jsonl").read_bytes() == before and checkpoint_steps(run_dir) == [2, 4]

    # cadence keys changed: continues from step 4 under the new cadence, in the same MLflow run
    second = run_flow("job.name=pol", "rl.max_steps=7", "rl.save_every=3", "rl.validation.every_steps=5")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(8))
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(before)  # steps 0..4 not rewritten
    has_val = {r["step"]: "val/accuracy" in r for r in records[5:]}
    assert has_val == {5: True, 6: False, 7: True}  # every_steps=5 (and the last step), not 2
    assert checkpoint_steps(run_dir) == [4, 6, 7]  # save_every=3 from here, the end; keep_checkpoints=3
    assert second["mlflow_run_id"] == run_id and second["step"] == 7
    assert "provenance/attempt_2.json" in artifact_paths(client, run_id)
    attempt2 = provenance(client, run_id, 2, tmp_path / "prov")
    assert attempt2["resumed_from"].endswith("step_00000004")
    run = client.get_run(run_id)
    assert run.data.tags["posttrain.attempts"] == "2" and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5, 6, 7]

    # off + job.overwrite: the old directory is deleted, a fresh run (new MLflow run) starts at 0
    third = run_flow("job.name=pol", "rl.max_steps=2", "rl.resume=off", "job.overwrite=true")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert checkpoint_steps(run_dir) == [2]
    assert third["mlflow_run_id"] != run_id
    assert run_state(run_dir)["mlflow_run_id"] == third["mlflow_run_id"]
    assert artifact_paths(client, third["mlflow_run_id"], "provenance") == ["provenance/attempt_1.json"]
    # the fresh run redid steps 1 and 2 of the same math
    assert_same_math(read_metrics(run_dir), records[:3])


# ---------------------------------------------------------------------------- corrupted checkpoint

def test_corrupted_newest_checkpoint_is_skipped_not_loaded(cwd, tmp_path):
    from infra.storage import CheckpointError, CheckpointStore

    client = mlflow_client(cwd)
    run_dir = cwd / "runs" / "corrupt"
    first = run_flow("job.name=corrupt", "rl.max_steps=4", "rl.save_every=2")
    original = read_metrics(run_dir)
    assert checkpoint_steps(run_dir) == [2, 4]

    part = run_dir / "checkpoints" / "step_00000004" / "trainer.safetensors"
    intact = part.read_bytes()
    raw = bytearray(intact)
    raw[len(raw) // 2] ^= 0x01  # one bit in the middle of the weights
    part.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="trainer.safetensors"):
        CheckpointStore(run_dir / "checkpoints").load(4)

    second = run_flow("job.name=corrupt", "rl.max_steps=5", "rl.save_every=2")
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    attempt2 = provenance(client, first["mlflow_run_id"], 2, tmp_path / "prov")
    assert attempt2["resumed_from"].endswith("step_00000002")  # not the corrupted step 4
    assert client.get_run(first["mlflow_run_id"]).data.tags["posttrain.resumed_from"].endswith("step_00000002")
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert resumed[:3] == original[:3]  # up to the checkpoint: the very same lines (timings included)
    assert all(resumed[s]["perf/step_s"] != original[s]["perf/step_s"] for s in (3, 4))  # redone ...
    assert_same_math(resumed[:5], original)  # ... to the same values
    # step 4 was saved again, valid, replacing the corrupted directory
    assert checkpoint_steps(run_dir) == [2, 4, 5]
    assert part.read_bytes() == intact  # the redone steps reproduce the state bit for bit


# ------------------------------------------------------------------------------------------- S3

@pytest.fixture
def bucket(moto_server, monkeypatch, tmp_path) -> str:
    import boto3

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-access-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key-resume")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def remote_files(bucket: str, prefix: str) -> dict[int, set[str]]:
    import boto3

    out: dict[int, set[str]] = {}
    for obj in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        step_dir, name = obj["Key"][len(prefix) + 1:].split("/")
        out.setdefault(int(step_dir.removeprefix("step_")), set()).add(name)
    return out


def test_checkpoints_to_s3_and_resume_from_s3_after_local_checkpoints_deleted(cwd, bucket, tmp_path):
    import boto3

    client = mlflow_client(cwd)
    run_dir = cwd / "runs" / "s3run"
    s3 = [f"tracking.checkpoint_uri=s3://{bucket}/run1", "tracking.keep_checkpoints=2", "rl.save_every=1",
          "job.name=s3run"]
    first = run_flow(*s3, "rl.max_steps=2")
    local = {p.name: sorted(f.name for f in p.iterdir()) for p in (run_dir / "checkpoints").iterdir()}
    assert sorted(local) == ["step_00000001", "step_00000002"]
    remote = remote_files(bucket, "run1/s3run")  # <checkpoint_uri>/<job.name>: per job
    assert sorted(remote) == [1, 2]
    for step in (1, 2):  # every local file, manifest included, is in S3
        assert remote[step] == set(local[f"step_{step:08d}"]) and "manifest.json" in remote[step]
        body = boto3.client("s3").get_object(Bucket=bucket, Key=f"run1/s3run/step_{step:08d}/manifest.json")["Body"]
        assert json.loads(body.read())["step"] == step
    before = read_metrics(run_dir)

    shutil.rmtree(run_dir / "checkpoints")
    second = run_flow(*s3, "rl.max_steps=3", "rl.resume=must")  # must: it has to find the S3 copy
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[:3] == before  # steps up to the restored checkpoint were not redone (timings too)
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    attempt2 = provenance(client, first["mlflow_run_id"], 2, tmp_path / "prov")
    assert attempt2["resumed_from"].endswith("step_00000002")
    # keep_checkpoints=2, remotely and locally: step 1 pruned, step 3 uploaded with its manifest
    remote = remote_files(bucket, "run1/s3run")
    assert sorted(remote) == [2, 3] and "manifest.json" in remote[3]
    assert checkpoint_steps(run_dir) == [2, 3]
    assert remote[3] == {f.name for f in (run_dir / "checkpoints" / "step_00000003").iterdir()}


@pytest.mark.slow
def test_resume_at_an_epoch_boundary_trains_the_remaining_steps(cwd):
    """A run resumed from a checkpoint at the end of an epoch trains the remaining steps (verl #5725 trained zero
    and exited cleanly). 8 train prompts, 4 per step: epochs end at steps 2, 4 and 6."""
    from safetensors.torch import load_file

    small = cwd / "train8.jsonl"
    small.write_text("".join((cwd / "data" / "arithmetic" / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    common = [f"data.train={small}", "rl.save_every=2", "rl.validation.every_steps=2"]
    run_flow(*common, "job.name=epoch-straight", "rl.max_steps=6")
    run_flow(*common, "job.name=epoch-resumed", "rl.max_steps=2")  # stops on the first epoch's last step
    result = run_flow(*common, "job.name=epoch-resumed", "rl.max_steps=6")
    assert result["step"] == 6
    straight, resumed = (read_metrics(cwd / "runs" / n) for n in ("epoch-straight", "epoch-resumed"))
    assert [r["step"] for r in resumed if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_same_math(resumed, straight)
    rows = [r["data/prompt_rows"] for r in resumed if "data/prompt_rows" in r]
    for epoch in range(3):  # every epoch, the resumed one included, visits each prompt once
        assert sorted(rows[2 * epoch] + rows[2 * epoch + 1]) == list(range(8))
    assert len({tuple(rows[2 * e] + rows[2 * e + 1]) for e in range(3)}) > 1  # and reshuffles
    a, b = (load_file(cwd / "runs" / n / "final_model" / "model.safetensors") for n in ("epoch-straight", "epoch-resumed"))
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
def test_resume_on_a_fresh_machine_restores_metrics_from_the_s3_checkpoint(cwd, bucket, tmp_path):
    """The whole run directory is gone (another machine): checkpoint, metrics history and MLflow run come from S3."""
    run_dir = cwd / "runs" / "fresh"
    s3 = [f"tracking.checkpoint_uri=s3://{bucket}/fresh", "rl.save_every=2", "job.name=fresh",
          "rl.validation.every_steps=1"]
    first = run_flow(*s3, "rl.max_steps=2")
    before = read_metrics(run_dir)
    assert [r["step"] for r in before] == [0, 1, 2] and "perf/checkpoint_s" in before[2]

    shutil.rmtree(run_dir)
    second = run_flow(*s3, "rl.max_steps=3", "rl.resume=must")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[:2] == before[:2]  # logged before the checkpoint: restored as they were, timings too
    # step 2's line was saved with the checkpoint, before its checkpoint time and its evaluation were known: the
    # resumed run evaluated step 2 again (same weights: same val/* values, a new perf/evaluate_s)
    retimed = ("perf/checkpoint_s", "perf/evaluate_s")
    assert {k: v for k, v in records[2].items() if k not in retimed} == \
        {k: v for k, v in before[2].items() if k not in retimed}
    assert "val/accuracy" in records[2] and "perf/evaluate_s" in records[2]
    assert second["mlflow_run_id"] == first["mlflow_run_id"]  # from the checkpoint's meta


def test_restore_metrics_fills_only_a_log_that_lacks_saved_steps(tmp_path):
    from flows.runner import restore_metrics
    from infra.tracking import MetricsLog

    saved = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "train/loss": 0.25}]
    text = "".join(MetricsLog.line(r) + "\n" for r in saved)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert restore_metrics(log, text) == [0, 1] and log.read() == saved  # no file: restored
    log.replace([{"step": 0, "val/accuracy": 0.5, "extra": 1.0}, {"step": 1, "train/loss": 0.25}])
    assert restore_metrics(log, text) == [] and log.read()[0]["extra"] == 1.0  # complete: kept as it is
    log.replace([{"step": 1, "train/loss": 0.25}])
    assert restore_metrics(log, text) == [0] and log.read() == saved  # a step missing: the saved copy wins
    assert restore_metrics(log, None) == [] and restore_metrics(log, "") == []  # an older checkpoint: nothing


# ----------------------------------------------------------------- exact resume after a real SIGKILL

MARKER_ENV = "POSTTRAIN_TEST_KILL_MARKER"
N_STEPS = 6
EXACT = ["rl.max_steps=6", "rl.save_every=2", "rl.validation.every_steps=2"]


def _pids_with_marker(marker: str) -> list[int]:
    """Processes started by one test run: they (and all their descendants, Ray's raylet, GCS, workers and
    the Prefect API server included) inherit its marker variable."""
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


def _kill_all(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL the run's process group, then every process carrying its marker (Ray workers lead their
    own process groups); wait until none is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while True:
        left = _pids_with_marker(marker)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"processes of the killed run still alive: {left}"
        time.sleep(0.2)
    proc.wait(timeout=30)


def start_cli(cwd: Path, prefect_home: Path, log: Path, marker: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_USAGE_STATS_ENABLED": "0",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": STARTUP_TIMEOUT_S, MARKER_ENV: marker}
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "wb") as out:
        return subprocess.Popen([str(VENV_BIN / "posttrain"), "run", recipe("arithmetic"), "--", *MATH, *overrides],
                                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def exact_cwd(tmp_path_factory, workdir, ref_model) -> Path:
    return make_cwd(tmp_path_factory.mktemp("exact") / "cwd", workdir, ref_model)


@pytest.fixture(scope="module")
def straight(exact_cwd) -> tuple[list[dict], dict]:
    """N steps without interruption: (metrics records, final model tensors)."""
    from safetensors.torch import load_file

    old = os.getcwd()
    os.chdir(exact_cwd)
    try:
        run_flow("job.name=straight", *EXACT)
    finally:
        os.chdir(old)
    run_dir = exact_cwd / "runs" / "straight"
    return read_metrics(run_dir), load_file(run_dir / "final_model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 1], ids=["k2-checkpoint", "k3-between-checkpoints", "k1-before-first-checkpoint"])
def test_exact_resume_after_sigkill(k, straight, exact_cwd, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(exact_cwd)
    straight_records, straight_weights = straight
    assert [r["step"] for r in straight_records] == list(range(N_STEPS + 1))
    losses = [r["train/loss"] for r in straight_records[1:]]
    assert all(x > 0 for x in losses) and len(set(losses)) == N_STEPS  # the trajectory is not trivial

    name = f"killed-k{k}"
    run_dir = exact_cwd / "runs" / name
    marker = uuid.uuid4().hex
    log = tmp_path / "killed.log"
    proc = start_cli(exact_cwd, tmp_path / "prefect", log, marker, f"job.name={name}", *EXACT)
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] == k for r in read_metrics(run_dir)):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before step {k}:\n" + \
                log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no step line within 600 s"
            time.sleep(0.05)
    finally:
        _kill_all(proc, marker)  # SIGKILL: no clean shutdown of anything
    assert proc.returncode == -signal.SIGKILL
    killed = read_metrics(run_dir)
    assert max(r["step"] for r in killed) == k, "the run got past the kill point; the scenario is not tested"
    expected_ckpt = [s for s in (2, 4, 6) if s <= k]
    assert checkpoint_steps(run_dir) == expected_ckpt
    run_id = run_state(run_dir)["mlflow_run_id"]

    result = run_flow(f"job.name={name}", *EXACT, "rl.resume=auto")
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(N_STEPS + 1)), "exactly one line per step"
    assert_same_math(resumed, straight_records)
    weights = load_file(run_dir / "final_model" / "model.safetensors")
    assert sorted(weights) == sorted(straight_weights)
    assert all(torch.equal(weights[key], straight_weights[key]) for key in weights)

    # the same MLflow run continued, with a second provenance attempt
    assert result["mlflow_run_id"] == run_id == run_state(run_dir)["mlflow_run_id"]
    client = mlflow_client(exact_cwd)
    assert {"provenance/attempt_1.json", "provenance/attempt_2.json"} <= set(artifact_paths(client, run_id))
    attempt2 = provenance(client, run_id, 2, tmp_path / "prov")
    if expected_ckpt:
        assert attempt2["resumed_from"].endswith(f"step_{expected_ckpt[-1]:08d}")
    else:
        assert attempt2["resumed_from"] is None
    assert client.get_run(run_id).info.status == "FINISHED"


def test_overwrite_does_not_leave_the_old_runs_checkpoints_in_s3(bucket, tmp_path, monkeypatch):
    from infra.resume import plan_resume
    from infra.storage import CheckpointStore, checkpoint_step

    monkeypatch.chdir(tmp_path)
    remote = [f"tracking.checkpoint_uri=s3://{bucket}/run1", "tracking.keep_checkpoints=2"]
    cfg = _cfg(*remote)

    def store() -> CheckpointStore:
        return CheckpointStore(Path(cfg.run_dir) / "checkpoints", keep=2, remote_uri=cfg.tracking.checkpoint_uri)

    for step in (4, 6):  # the old run got to step 6
        _save(store(), cfg, step, run_id="old-run")
    fresh = _cfg(*remote, "rl.resume=off", "job.overwrite=true")
    assert plan_resume(fresh, store()).checkpoint is None
    _save(store(), fresh, 2, run_id="new-run")  # the new run's first checkpoint
    shutil.rmtree(Path(cfg.run_dir) / "checkpoints")  # the machine is lost; resume from S3
    restored = store().latest_valid()
    assert restored is not None and checkpoint_step(restored) == 2


def test_changed_math_key_is_refused_before_the_first_checkpoint_too(tmp_path, monkeypatch):
    from infra.resume import plan_resume, write_run_state
    from infra.storage import CheckpointStore
    from rl_core.config import ConfigError, config_hash, write_resolved

    monkeypatch.chdir(tmp_path)
    cfg = _cfg()
    run_dir = Path(cfg.run_dir)
    write_resolved(cfg, run_dir)  # what a run killed at step 1 leaves: no checkpoint yet
    write_run_state(run_dir, {"mlflow_run_id": "run-abc", "config_hash": config_hash(cfg)})
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    changed = _cfg("rl.optimizer.lr=2e-3")
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.lr"):
        plan_resume(changed, CheckpointStore(Path(changed.run_dir) / "checkpoints"))


def test_overwrite_deletes_only_a_recognisable_run_directory(tmp_path, monkeypatch):
    """job.overwrite=true with a job.out_dir/job.name that points at other data refuses and deletes nothing."""
    from infra.resume import plan_resume
    from infra.storage import CheckpointStore
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    precious = tmp_path / "home"
    (precious / "thesis").mkdir(parents=True)
    (precious / "thesis" / "draft.tex").write_text("years of work")
    (tmp_path / "afile").write_text("not a directory")
    for out_dir, name in ((str(tmp_path), "home"), (str(tmp_path), "afile")):
        cfg = _cfg("rl.resume=off", "job.overwrite=true", f"job.out_dir={out_dir}", f"job.name={name}")
        store = CheckpointStore(tmp_path / name / "checkpoints", keep=3)
        with pytest.raises(ConfigError, match="not a posttrain run directory"):
            plan_resume(cfg, store)
    assert (precious / "thesis" / "draft.tex").read_text() == "years of work"
    assert (tmp_path / "afile").read_text() == "not a directory"
    # a real run directory with a stray user file in it: also refused, named
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "my_notes.txt").write_text("keep")
    cfg = _cfg("rl.resume=off", "job.overwrite=true", f"job.out_dir={tmp_path / 'runs'}", "job.name=r")
    with pytest.raises(ConfigError, match="my_notes.txt"):
        plan_resume(cfg, CheckpointStore(run / "checkpoints", keep=3))
    (run / "my_notes.txt").unlink()
    plan_resume(cfg, CheckpointStore(run / "checkpoints", keep=3))  # now a plain run: deleted
    assert not run.exists()


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path):
    """A crash mid-append leaves a last line without its newline: it is skipped (its step is redone);
    a bad line in the middle is an error naming the file and line."""
    from infra.tracking import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    log = MetricsLog(path)
    assert [r["step"] for r in log.read()] == [1, 2]
    log.truncate_after(2)  # what a resume does: the torn line is gone, the file is whole again
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        MetricsLog(path).read()


def test_bad_data_fails_before_an_overwrite_deletes_the_previous_run(cwd, tmp_path):
    """rl.resume=off job.overwrite=true with an empty train file: the flow fails naming data.train, and the run
    directory it would have replaced (checkpoints, metrics) is untouched."""
    from rl_core.config import ConfigError

    run_dir = cwd / "runs" / "keep"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"data\.train=.*no examples"):
        run_flow("job.name=keep", "rl.resume=off", "job.overwrite=true", f"data.train={empty}")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run_dir / "checkpoints" / "step_00000002" / "manifest.json").is_file()


def test_runs_sharing_a_checkpoint_uri_keep_their_checkpoints_apart(bucket, tmp_path, monkeypatch):
    """Two jobs with one tracking.checkpoint_uri: each lists, loads and prunes only its own steps."""
    from infra.resume import checkpoint_prefix, plan_resume
    from infra.storage import CheckpointStore, checkpoint_step

    monkeypatch.chdir(tmp_path)
    shared = [f"tracking.checkpoint_uri=s3://{bucket}/team", "tracking.keep_checkpoints=1"]
    a, b = _cfg(*shared, "job.name=alpha"), _cfg(*shared, "job.name=beta")
    assert checkpoint_prefix(a) == f"s3://{bucket}/team/alpha"

    def store(cfg) -> CheckpointStore:
        return CheckpointStore(Path(cfg.run_dir) / "checkpoints", keep=1, remote_uri=checkpoint_prefix(cfg))

    _save(store(a), a, 7, run_id="alpha-run")
    _save(store(b), b, 3, run_id="beta-run")  # keep_checkpoints=1 prunes only beta's older steps
    for cfg in (a, b):
        shutil.rmtree(Path(cfg.run_dir) / "checkpoints")  # machines lost: resume from S3
    assert checkpoint_step(store(a).latest_valid()) == 7
    assert checkpoint_step(store(b).latest_valid()) == 3
    assert plan_resume(b, store(b)).run_state == {"mlflow_run_id": "beta-run"}


def test_a_second_run_of_the_same_directory_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    """The run lock: another process holding it (a deployment triggered twice) makes prepare fail at once,
    naming the holder, with the first run's files untouched; a kill -9 of the holder frees it."""
    import signal
    import subprocess
    import sys

    from flows.runner import TrainingRun
    from infra.resume import RunLocked

    monkeypatch.chdir(tmp_path)
    cfg = _cfg("job.name=locked")
    run_dir = Path(cfg.run_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from infra.resume import RunLock; from rl_core.config import load_config; "
         "cfg = load_config(sys.argv[2], ['job.name=locked']); lock = RunLock(cfg).acquire(); print('held', flush=True); "
         "time.sleep(120)"), str(Path(__file__).resolve().parents[1]), recipe("arithmetic")],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for mode in ("auto", "off"):
            with pytest.raises(RunLocked, match=rf"in use by pid {holder.pid} "):
                TrainingRun.prepare(_cfg("job.name=locked", f"rl.resume={mode}", "job.overwrite=true"), "r", [],
                                    announce=print)
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the OS released the dead holder's lock, and this process now holds it
    with TrainingRun.prepare(cfg, "r", [], announce=print) as run, pytest.raises(RunLocked):
        TrainingRun.prepare(cfg, "r", [], announce=print)
    with TrainingRun.prepare(cfg, "r", [], announce=print):  # released by the context exit
        pass
    assert run.lock is not None


# ------------------------------------------------------------------------------ faults survived


@pytest.mark.slow
def test_a_killed_trainer_rank_is_restarted_from_the_last_checkpoint(cwd):
    """SIGKILL of a PolicyWorker (a Ray actor) after step 3 of 6 (checkpoints every 2 steps): the flow places
    every role again, resumes from step 2 and finishes; steps 1-6 are logged once each, and steps 1-2 are the
    same lines as before the kill (only step 3 was redone)."""
    import signal
    import threading
    import time

    run_dir = cwd / "runs" / "killed"
    killed: dict = {}

    def killer() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            records = read_metrics(run_dir)
            placement = run_dir / "placement.json"
            if any(r.get("step") == 3 for r in records) and placement.is_file():
                pid = json.loads(placement.read_text())["trainers"][0]["pid"]
                killed.update(pid=pid, before=records)
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = run_flow("job.name=killed", "rl.max_steps=6", "rl.save_every=2", "rl.validation.every_steps=0",
                      "rl.validation.before_training=false", "rl.resume=off")
    thread.join(timeout=5)
    assert killed, "the trainer rank was never killed"
    assert result["restarts"] == 1 and result["step"] == 6
    records = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    before = [r for r in killed["before"] if "train/loss" in r]
    assert records[:2] == before[:2]  # restored from the step-2 checkpoint, not redone
    new_pid = json.loads((run_dir / "placement.json").read_text())["trainers"][0]["pid"]
    assert new_pid != killed["pid"]


def test_a_failing_evaluation_keeps_its_steps_checkpoint_and_a_resume_finishes_it(cwd, monkeypatch):
    """Evaluation fails at step 2 on every try (1 retry): step 2's checkpoint is already written, so nothing is
    lost; the resumed run does not train step 2 again, it evaluates it (with step 2's weights) and completes the
    step's metrics line."""
    import tasks.evaluate
    from rl_core.evaluation import evaluate_accuracy

    calls = {"failed": 0, "ran": 0}

    def broken(*args, **kwargs):
        calls["failed"] += 1
        raise RuntimeError("injected evaluation failure")

    def counted(*args, **kwargs):
        calls["ran"] += 1
        return evaluate_accuracy(*args, **kwargs)

    run_dir = cwd / "runs" / "evalfail"
    common = ["job.name=evalfail", "rl.max_steps=2", "rl.save_every=2", "rl.validation.every_steps=2",
              "rl.validation.before_training=false", "job.task_retries=1", "job.retry_delay_s=0"]
    monkeypatch.setattr(tasks.evaluate, "evaluate_accuracy", broken)
    with pytest.raises(Exception, match="injected evaluation failure"):
        run_flow(*common)
    assert calls["failed"] == 2  # the try and its retry
    assert checkpoint_steps(run_dir) == [2]  # written before the evaluation
    assert [r["step"] for r in read_metrics(run_dir)] == [1]

    monkeypatch.setattr(tasks.evaluate, "evaluate_accuracy", counted)
    result = run_flow(*common, "rl.resume=must")
    assert result["step"] == 2 and calls["ran"] == 1
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert "train/loss" in records[1] and "val/accuracy" in records[1] and "perf/evaluate_s" in records[1]
    history = mlflow_client(cwd).get_metric_history(result["mlflow_run_id"], "val/accuracy")
    assert [(m.step, m.value) for m in history] == [(2, records[1]["val/accuracy"])]


TEARDOWN_SCRIPT = """
import ray
from infra.cluster import Cluster
from rl_core.config import load_config

class Actor:
    def shutdown(self):
        pass

ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False, log_to_driver=False)
cluster = Cluster(load_config(RECIPE, []))
dead, alive = ray.remote(Actor).remote(), ray.remote(Actor).remote()
ray.get([dead.shutdown.remote(), alive.shutdown.remote()])
ray.kill(dead, no_restart=True)
cluster.workers, cluster.engine_actors, cluster.started_ray = [dead], [alive], True
ray.shutdown()  # Ray is gone before the teardown
try:
    ray.kill(alive, no_restart=True)
    raise SystemExit("ray.kill without Ray did not raise: this test no longer tests anything")
except SystemExit:
    raise
except Exception:
    pass
cluster.__exit__(None, None, None)
assert cluster.workers == [] and cluster.engine_actors == [] and cluster.engines is None
assert not cluster.started_ray and not ray.is_initialized()
print("teardown ok")
"""


def test_cluster_teardown_survives_dead_actors_and_a_ray_that_is_already_gone(tmp_path):
    """A restart tears the old cluster down after an actor died, sometimes after Ray itself went away: every
    clean-up call (shutdown.remote, ray.kill) then raises, and each is skipped so the rest still runs. In a
    subprocess: it stops its own Ray, not the session's."""
    from tests.conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    script = TEARDOWN_SCRIPT.replace("RECIPE", repr(recipe("arithmetic")))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0 and "teardown ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_the_restart_budget_is_bounded_and_only_actor_deaths_restart():
    from ray.exceptions import ActorDiedError

    from flows.runner import run_with_restarts
    from rl_core.config import ConfigError

    cfg = _cfg("job.max_restarts=2", "rl.resume=off")
    seen = []

    def dies(c):
        seen.append(c.rl.resume)
        raise ActorDiedError()

    with pytest.raises(RuntimeError, match=r"after 2 automatic restart\(s\) \(job\.max_restarts=2\)"):
        run_with_restarts(cfg, dies, announce=lambda *a: None)
    assert seen == ["off", "auto", "auto"]  # the first attempt as asked, restarts resume
    calls = []

    def bad_config(c):
        calls.append(1)
        raise ConfigError(["x: wrong"])

    with pytest.raises(ConfigError):
        run_with_restarts(cfg, bad_config, announce=lambda *a: None)
    assert calls == [1]  # not an actor death: no restart
