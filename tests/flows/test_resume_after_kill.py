"""Runs that are killed and resumed, end to end: real Prefect, real local Ray, MLflow on SQLite.

* exact resume after a real SIGKILL of the `posttrain run` process (slow): N steps straight equal
  k steps + kill + resume, in every metrics.jsonl value, at a checkpoint boundary, between
  checkpoints and before the first checkpoint;
* a killed trainer rank is restarted from the last checkpoint; the restart budget;
* a failing evaluation keeps its step's checkpoint and a resume finishes it;
* cluster teardown with dead actors and Ray already gone.

The runs use tests.run_helpers.MATH: a KL anchor to a different random-init reference and a
learning-rate warmup, so every state has to be restored exactly for the trajectories to agree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.builders import STARTUP_TIMEOUT_S
from tests.conftest import make_cwd, recipe
from tests.run_helpers import (
    MATH,
    VENV_BIN,
    artifact_paths,
    assert_same_math,
    checkpoint_steps,
    mlflow_client,
    provenance,
    read_metrics,
    run_flow,
    run_state,
    small_config,
)

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


def start_cli(cwd: Path, prefect_home: Path, api: str, log: Path, marker: str, *overrides: str) -> subprocess.Popen:
    """`posttrain run` in a session of its own, against the module's Prefect API server (`api`)."""
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PREFECT_API_URL": api, "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_USAGE_STATS_ENABLED": "0",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(STARTUP_TIMEOUT_S), MARKER_ENV: marker}
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


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 1], ids=["k2-checkpoint", "k3-between-checkpoints", "k1-before-first-checkpoint"])
def test_exact_resume_after_sigkill(k, straight, exact_cwd, prefect_api, tmp_path, monkeypatch):
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
    proc = start_cli(exact_cwd, tmp_path / "prefect", prefect_api, log, marker, f"job.name={name}", *EXACT)
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
    # A step's line waits for the checkpoint in flight to be published (runner.log), so the line of the step after
    # a checkpoint can be written with the checkpoint's own: the kill lands at k or later, before the next one.
    next_ckpt = min(s for s in (2, 4, 6) if s > k)
    assert k <= max(r["step"] for r in killed) < next_ckpt, "the run got past the next checkpoint; not the scenario"
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_failing_evaluation_keeps_its_steps_checkpoint_and_a_resume_finishes_it(cwd, monkeypatch):
    """Evaluation fails at step 2 on every try (1 retry): step 2's checkpoint is already written, so nothing is
    lost; the resumed run does not train step 2 again, it evaluates it (with step 2's weights) and completes the
    step's metrics line."""
    import tasks.evaluate
    from rl_core.evaluation.heldout import evaluate_accuracy

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
from infra.workers.actor import ActorGroup
from infra.cluster.cluster import Cluster
from infra.cluster.placement import Placement
from rl_core.config import load_config

class Actor:
    def shutdown(self):
        pass

ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False, log_to_driver=False)
cfg = load_config(RECIPE, [])
cluster = Cluster(cfg, placement=Placement(cfg))
dead, alive = ray.remote(Actor).remote(), ray.remote(Actor).remote()
ray.get([dead.shutdown.remote(), alive.shutdown.remote()])
ray.kill(dead, no_restart=True)
for role, actor in (("trainers", dead), ("engines", alive)):
    group = cluster.placement.groups[role] = ActorGroup(role, Actor, 1, lambda i: ())
    group.actors, group.placed = [actor], True
cluster.placement.started_ray = True
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


@pytest.mark.e2e
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

    from flows.restarts import run_with_restarts
    from rl_core.config import ConfigError

    cfg = small_config("job.max_restarts=2", "rl.resume=off")
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


def test_a_reward_whose_worker_died_fails_as_a_reward_error_and_never_restarts_the_trainers():
    """A reward that kills its own process: the RewardError raised while handling the dead reward actor's error
    (`from None`, so Python still keeps that error as its context) was taken for a lost trainer, and the run
    re-placed every role up to job.max_restarts. A user-code error is never a lost actor; a trainer's death, also
    raised while handling another error, still is."""
    from ray.exceptions import ActorDiedError

    from flows.restarts import lost_actor, run_with_restarts
    from rl_core.rewards import RewardError

    def reward_worker_died():
        try:
            raise ActorDiedError()
        except ActorDiedError:
            raise RewardError("a reward worker's process ended before reward 'units' (data.rewards[1]) "
                              "returned") from None

    def trainer_died_in_a_task():
        try:
            raise ActorDiedError()
        except ActorDiedError as exc:
            raise RuntimeError("the train task failed") from exc

    for body, restarts in ((reward_worker_died, 0), (trainer_died_in_a_task, 1)):
        try:
            body()
        except Exception as exc:  # noqa: BLE001
            assert lost_actor(exc) is bool(restarts)
        calls = []

        def attempt(c, body=body, calls=calls):
            calls.append(c.rl.resume)
            body()

        with pytest.raises(RewardError if body is reward_worker_died else RuntimeError):
            run_with_restarts(small_config(f"job.max_restarts={restarts}"), attempt, announce=lambda *a: None)
        assert len(calls) == 1 + restarts
