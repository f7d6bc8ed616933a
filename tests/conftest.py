"""Shared fixtures: an isolated Prefect home, and a work directory with the tiny model and data built.

Flow tests run real Prefect (ephemeral API), real local Ray and MLflow on SQLite inside a temporary
working directory; nothing is written to the user's ~/.prefect or the repository.

Unit tests and end-to-end tests: a test that starts Ray, runs a Prefect flow (the ephemeral API is a server
subprocess) or starts any other process carries the `e2e` marker; only those get the session's local Ray.
`make test-quick` (POSTTRAIN_TEST_QUICK=1, `-m "not e2e and not slow"`) runs the rest, and there any process
a test starts fails it with a message naming the marker (`pytest_runtest_protocol` below).
"""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing.process
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from infra.processes import passive_openmp

# A pytest worker is a process role of its own: one torch thread (`make test` runs two workers on two cores) whose
# OpenMP runtime sleeps when idle. Set before anything imports torch; the processes a test starts (`posttrain run`,
# Ray, servers) inherit both, and the run's actors set their own thread counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
passive_openmp()

from infra.services.prefect_api import use_prefect_server_defaults
from tests.builders import STARTUP_TIMEOUT_S
from tests.servers import UNUSED_PREFECT_SERVICES

REPO = Path(__file__).resolve().parents[1]
# Set before anything imports prefect: its settings are read once. The session's process makes it (xdist's workers
# and the processes tests start inherit it) and removes it when it exits.
if "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="posttrain-test-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray on 127.0.0.1 only (it would otherwise advertise the outward interface): read by ray at import
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# the ephemeral Prefect API may take longer than its default 20 s to start on a loaded 2-core machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(STARTUP_TIMEOUT_S))
# the API server settings `posttrain run` and `posttrain services` start Prefect with (batched task-run recording)
use_prefect_server_defaults()
for _name, _value in UNUSED_PREFECT_SERVICES.items():  # the temporary APIs' idle loops (tests/servers.py)
    os.environ.setdefault(_name, _value)
# platform.processor() runs `uname -p` once per process and caches it (MLflow's run tags ask for it): asked here,
# before any test, so that no unit test starts that process
platform.processor()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A working directory with the arithmetic data and the tiny random-init model (no warm start)."""
    from rl_core.data.arithmetic import make_arithmetic_data
    from rl_core.model.loading import build_tiny_model

    root = tmp_path_factory.mktemp("work")
    make_arithmetic_data(root / "data" / "arithmetic", seed=0)
    build_tiny_model(root / "artifacts" / "tiny-model" / "init", seed=0)
    return root


E2E = "e2e"


def quick_mode(config: pytest.Config) -> bool:
    """Unit tests only: `make test-quick` (POSTTRAIN_TEST_QUICK=1), or a marker expression that leaves e2e out."""
    return os.environ.get("POSTTRAIN_TEST_QUICK") == "1" or "not e2e" in (config.option.markexpr or "")


class StartsAProcess(RuntimeError):
    """A test without the `e2e` marker started Ray, Prefect's API server or another process (quick mode)."""


_STARTED: list[str] = []  # what the running unit test started, reported by pytest_runtest_makereport


def pytest_configure(config):
    """In quick mode, matplotlib's font cache is built here, before any test: its first import on a machine runs
    `fc-list`, a process the unit tests may not start."""
    if quick_mode(config):
        import matplotlib.font_manager  # noqa: F401


# The longest modules (a clean clone's `make test`, slowest first), run first: `--dist loadfile
# --no-loadscope-reorder` (Makefile) hands each worker a whole module at a time in collection order, so a long module
# handed out last would run alone at the end.
HEAVIEST_FIRST = (
    "tests/flows/test_deployments.py", "tests/flows/test_resume_after_kill.py", "tests/flows/test_dpo_flow.py",
    "tests/flows/test_opd_flow.py", "tests/flows/test_resume.py", "tests/infra/cluster/test_scale_out.py",
    "tests/infra/workers/test_vllm_cpu.py", "tests/flows/test_dvc.py", "tests/infra/cluster/test_faults.py",
    "tests/infra/cluster/test_ray_cluster.py", "tests/infra/workers/test_fsdp.py", "tests/flows/test_lora_flow.py",
    "tests/test_front_door.py", "tests/flows/test_regression.py",
    "tests/flows/test_flow.py", "tests/flows/test_gsm8k_recipes.py", "tests/flows/test_posttrain_run.py",
    "tests/infra/tracking/test_tracking_e2e.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (`HEAVIEST_FIRST`; the others keep their order after them). Every `e2e` test gets
    the session's local Ray (`ray_session`) and its migrated Prefect database (`prefect_home`) before any other
    fixture, so a module-scoped fixture that runs a flow joins them too."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    for item in items:
        if item.get_closest_marker(E2E) is not None:
            for name in ("ray_session", "prefect_home"):
                if name not in item.fixturenames:
                    item.fixturenames.insert(0, name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In quick mode a test without the `e2e` marker may start no process, in its fixtures (of any scope) either:
    subprocess.Popen (what subprocess.run, `ray.init`'s GCS and raylet, Prefect's ephemeral API server and the
    test servers start with), os.system, multiprocessing's Process.start (process pools, torch.multiprocessing)
    and an imported `ray.init` raise StartsAProcess, and the test fails even if the code under test caught it."""
    if not quick_mode(item.config) or item.get_closest_marker(E2E) is not None:
        return (yield)

    def refuse(what: Callable[..., str]):
        def call(*args, **kwargs):
            message = (f"{item.nodeid} {what(*args, **kwargs)}, which a unit test must not: mark it "
                       f"`@pytest.mark.{E2E}` (it starts Ray, a Prefect server or flow, or a subprocess) "
                       f"so that `make test-quick` leaves it out")
            _STARTED.append(message)
            raise StartsAProcess(message)
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child",
                   refuse(lambda self, args, *_, **__: f"started a subprocess ({args!r:.300})"))
        mp.setattr(os, "system", refuse(lambda command: f"ran os.system({command!r:.300})"))
        mp.setattr(multiprocessing.process.BaseProcess, "start",
                   refuse(lambda self: f"started a multiprocessing process ({self!r:.300})"))
        if "ray" in sys.modules:
            mp.setattr(sys.modules["ray"], "init", refuse(lambda *_, **__: "called ray.init"))
        try:
            return (yield)
        finally:
            _STARTED.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _STARTED:
        report.outcome = "failed"
        report.longrepr = "\n".join([*_STARTED, "", str(report.longrepr or "")])
        _STARTED.clear()
    return report


# The session Ray idles between flows for the whole run: no test reads Ray's own metrics, whose collection (the
# dashboard agent's reporter, each process's metrics reports) is about 1 of the 5-6 CPU-s a minute an idle local Ray
# burns on a 2-core machine.
IDLE_RAY_CONFIG = {"enable_metrics_collection": False}
# The Ray the pytest workers of a run share (`shared_ray`): the logical CPUs and the object store that three workers'
# own local Rays would have (8 CPUs, 256 MiB each), so that three flows at once fit as one does.
SHARED_RAY_CPUS = 24
SHARED_RAY_OBJECT_STORE_MB = 768
# The run's own directory, made by the pytest process that runs the session (under xdist, the controller; its workers
# inherit both variables): where the shared Ray keeps its temp dir, address and process id. A pytest started by a
# test (a nested run) sees an owner that is not its own or its parent's process, and makes its own.
RUN_DIR, RUN_OWNER = "POSTTRAIN_TEST_RUN_DIR", "POSTTRAIN_TEST_RUN_OWNER"
if os.environ.get(RUN_OWNER) not in (str(os.getpid()), str(os.getppid())):
    os.environ[RUN_DIR] = tempfile.mkdtemp(prefix="posttrain-test-run-")
    os.environ[RUN_OWNER] = str(os.getpid())
    atexit.register(shutil.rmtree, os.environ[RUN_DIR], ignore_errors=True)


def shared_ray() -> str:
    """The address of the one local Ray the pytest workers of this run share (without xdist, the session's own),
    started by the first worker that asks (under a file lock) and stopped by the run's pytest process when the
    session ends (`pytest_sessionfinish`), or by itself once that process is gone. One Ray instead of one per
    worker: two fewer sets of Ray's own processes (GCS, raylet, dashboard, log monitor, autoscaler monitor) idling
    through the run on a 2-core machine."""
    from filelock import FileLock

    from infra.cluster.ray_connect import LOCAL_SYSTEM_CONFIG
    from tests.servers import start_shared_ray

    run = Path(os.environ[RUN_DIR])
    address, pid = run / "ray-address", run / "ray-pid"
    with FileLock(str(run / "ray.lock")):
        if not address.is_file():
            started, head = start_shared_ray(run / "ray", cpus=SHARED_RAY_CPUS,
                                             object_store_mb=SHARED_RAY_OBJECT_STORE_MB,
                                             system_config={**LOCAL_SYSTEM_CONFIG, **IDLE_RAY_CONFIG},
                                             owner_pid=int(os.environ[RUN_OWNER]))
            pid.write_text(str(started))
            address.write_text(head)
    return address.read_text()


def pytest_sessionfinish(session):
    """The run's pytest process stops the shared Ray (`shared_ray`) by its process id, after its workers are done."""
    if hasattr(session.config, "workerinput") or os.environ.get(RUN_OWNER) != str(os.getpid()):
        return
    pid = Path(os.environ[RUN_DIR]) / "ray-pid"
    if pid.is_file():
        from tests.servers import stop_shared_ray

        stop_shared_ray(int(pid.read_text()), Path(os.environ[RUN_DIR]) / "ray")


@pytest.fixture(scope="session")
def ray_session():
    """The Ray of the session's in-process flows, connected by the first `e2e` test: the one local Ray (127.0.0.1)
    that all pytest workers of the run share (`shared_ray`), or the cluster RAY_ADDRESS names (then this yields None).

    `Cluster` joins a Ray that is already initialised instead of starting its own, so each flow
    still places and kills its own worker (and teacher) actors, but does not pay Ray's start and
    stop (~4 s) every time; the `posttrain run`s of `dvc repro` join it too (`ray_address`). The start-your-own path
    (`Cluster` starting and stopping a local Ray) is exercised by the other tests that run `posttrain` in a
    subprocess: the SIGKILL resumes, the deployments' worker, `make demo`. Requested by `e2e` tests only
    (pytest_collection_modifyitems): unit tests run without Ray. Other workers' flows run on the same Ray: a test
    checks what its own Ray job holds, never the cluster's free resources.
    """
    import ray

    if os.environ.get("RAY_ADDRESS"):
        yield None
        return
    ray.init(address=shared_ray(), log_to_driver=True, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The address a `posttrain run` subprocess joins (its RAY_ADDRESS) to run on the session's Ray (token
    authentication off) instead of starting one of its own."""
    return os.environ["RAY_ADDRESS"] if ray_session is None else ray_session.get_runtime_context().gcs_address


def _build_warm(start: Path, root: Path, workdir: Path, which: str) -> tuple[Path, dict]:
    """`which` in {"warm_start", "teacher_warm_start"} of params.yaml, trained from `start` on the workdir's data
    exactly as `infra.artifacts.ensure_quickstart_artifacts` builds a missing artifact."""
    from infra.artifacts import load_params
    from rl_core.training.warm_start import warm_start

    params = load_params(REPO / "params.yaml")
    data = workdir / "data" / "arithmetic"
    out = root / which
    metrics = warm_start(start, data / "train.jsonl", data / "val.jsonl", out, **params[which])
    return out, metrics


def built_once(tmp_path_factory, name: str, build: Callable[[Path], tuple[Path, dict]]) -> tuple[Path, dict]:
    """`build(root)` -> (directory, JSON-able metrics), run once per test run: under pytest-xdist the first worker
    to ask builds it in the run's base temp dir (shared by the workers) under a file lock, and the others wait and
    read what it saved. Without xdist it is built in this session's own temp dir. Either way the metrics come
    back through JSON, so every worker sees the same values (floats round-trip exactly)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.mktemp(name)
        path, metrics = build(root)
        return path, json.loads(json.dumps(metrics))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "built-once"  # pytest-of-<user>/pytest-<n>/: this run's
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.is_file():
            path, metrics = build(shared / name)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"path": str(path), "metrics": metrics}))
            tmp.replace(done)
    saved = json.loads(done.read_text())
    return Path(saved["path"]), saved["metrics"]


@pytest.fixture(scope="session")
def warm_model(workdir, tmp_path_factory) -> tuple[Path, dict]:
    """The quickstart's warm start (`warm_start` of params.yaml from the init), built once per test run (one
    xdist worker builds it, `built_once`): (directory, metrics). Read-only: tests copy it to change it."""
    return built_once(tmp_path_factory, "warm", lambda root: _build_warm(
        workdir / "artifacts" / "tiny-model" / "init", root, workdir, "warm_start"))


@pytest.fixture(scope="session")
def teacher_model(workdir, warm_model, tmp_path_factory) -> tuple[Path, dict]:
    """OPD's CPU teacher (`teacher_warm_start` of params.yaml: the warm start trained further), built once per
    test run (`built_once`): (directory, metrics)."""
    return built_once(tmp_path_factory, "teacher", lambda root: _build_warm(
        warm_model[0], root, workdir, "teacher_warm_start"))


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 for one test module (`tests/servers.py`); yields its URL."""
    from tests.servers import moto_server as serve

    with serve(tmp_path_factory.mktemp("moto")) as url:
        yield url


def _build_prefect_db(root: Path) -> tuple[Path, dict]:
    """A Prefect SQLite database migrated to the installed Prefect's head, as a server's first start makes it (in a
    process of its own, whose PREFECT_HOME is `root`): (the database file, {})."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(root)
    code = ("import asyncio; from prefect.server.database import provide_database_interface as db; "
            "asyncio.run(db().create_db())")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=STARTUP_TIMEOUT_S)
    return root / "prefect.db", {}


@pytest.fixture(scope="session")
def prefect_db(tmp_path_factory) -> Path:
    """A migrated Prefect database, built once per test run (`built_once`): every Prefect API a test starts (the
    worker's temporary one, `prefect_api`, the services) begins from a copy of it instead of migrating a database of
    its own (seconds of CPU each on a 2-core machine). Read-only: `tests.servers.seed_prefect_home` copies it."""
    return built_once(tmp_path_factory, "prefect-db", _build_prefect_db)[0]


@pytest.fixture(scope="session")
def prefect_home(prefect_db) -> Path:
    """This process's PREFECT_HOME (where its in-process flows' temporary API keeps its database), seeded with the
    migrated database before the first flow; requested by every `e2e` test (pytest_collection_modifyitems)."""
    from tests.servers import seed_prefect_home

    home = Path(os.environ["PREFECT_HOME"])
    seed_prefect_home(home, prefect_db)
    return home


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory, prefect_db):
    """A `prefect server` on 127.0.0.1 for one test module (`tests/servers.py`); yields its API URL. The module's
    `posttrain run` subprocesses that are not about start-up get it as PREFECT_API_URL: each would otherwise start
    a temporary API server of its own (seconds of CPU on a loaded machine)."""
    from tests.servers import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server"), prefect_db) as url:
        yield url


@pytest.fixture
def bucket(moto_server, monkeypatch, tmp_path) -> str:
    """A fresh bucket on the module's moto server, with this process's AWS settings pointing at it (and nothing
    from ~/.aws); yields its name."""
    import uuid

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


@pytest.fixture
def mlflow_server(tmp_path):
    """An `mlflow server` on 127.0.0.1 for one test (`tests/servers.py`); yields `(url, artifact_root)`."""
    from tests.servers import mlflow_server as serve

    with serve(tmp_path) as served:
        yield served


@pytest.fixture
def in_workdir(workdir, monkeypatch) -> Path:
    monkeypatch.chdir(workdir)
    return workdir


def recipe(name: str) -> str:
    return str(REPO / "recipes" / f"{name}.py")


# What a short test run leaves out unless it is what the test is about: the reward actors (rewards run in the driver;
# tests/infra/workers/test_reward_pool.py has the pool), MLflow's system-metrics sampler and the completions table
# (tests/infra/tracking/test_tracking*.py turn them on).
LEAN = [
    "data.reward_workers=0",
    "tracking.system_metrics=false",
    "tracking.sample_completions_every=0",
]
# Short CPU runs of the arithmetic recipe on the random-init tiny model (fast to build).
FAST = [
    "model.name_or_path=artifacts/tiny-model/init",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rl.validation.max_prompts=16",
    "rl.validation.every_steps=2",
    *LEAN,
]


# --------------------------------------------- private working directories for in-process flow runs

@pytest.fixture(scope="module")
def ref_model(tmp_path_factory) -> Path:
    """A second random-init tiny model (another seed): the KL reference."""
    from rl_core.model.loading import build_tiny_model

    path = tmp_path_factory.mktemp("ref") / "ref"
    build_tiny_model(path, seed=1)
    return path


@functools.cache
def _mlflow_template() -> Path:
    """An empty MLflow SQLite store with its schema migrated, built once per process, removed when it exits."""
    import sqlite3

    from mlflow import MlflowClient

    root = Path(tempfile.mkdtemp(prefix="posttrain-test-mlflow-"))
    atexit.register(shutil.rmtree, root, True)
    template = root / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
    with sqlite3.connect(template) as db:
        db.execute("DELETE FROM experiment_tags")
        db.execute("DELETE FROM experiments")
    return template


def migrated_mlflow_db(directory: Path) -> Path:
    """`directory`/mlflow.db: a copy of `_mlflow_template`. A new store runs every MLflow migration first (seconds on
    a loaded machine); a copy opens at once. The copy holds no experiment: MLflow creates the Default one, with the
    directory's own artifact location, when it opens a store without it."""
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(_mlflow_template(), directory / "mlflow.db"))


def make_cwd(path: Path, workdir: Path, ref: Path) -> Path:
    """A private working directory (own runs/, own mlflow.db, migrated) sharing the session's data and model."""
    migrated_mlflow_db(path)
    (path / "artifacts" / "tiny-model").mkdir(parents=True)
    (path / "data").symlink_to(workdir / "data", target_is_directory=True)
    (path / "artifacts" / "tiny-model" / "init").symlink_to(workdir / "artifacts" / "tiny-model" / "init")
    (path / "artifacts" / "tiny-model" / "ref").symlink_to(ref)
    return path


@pytest.fixture
def cwd(tmp_path, workdir, ref_model, monkeypatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = make_cwd(tmp_path / "cwd", workdir, ref_model)
    monkeypatch.chdir(path)
    return path
