"""Loopback services the tests start and stop by their own process ids: moto's S3 server, an MLflow server, a
Prefect API server, Ray clusters (the pytest workers' shared one among them).

Fixtures in `conftest.py` wrap these (`moto_server` and `prefect_api` per test module, `mlflow_server` per
test). Ports, console scripts, polling and process-group signals are `infra.services.supervisor`' (what `posttrain
services` uses).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.processes import free_port, signal_group, wait_until
from infra.services.prefect_api import PREFECT_SERVER_DEFAULTS, http_ok
from infra.services.supervisor import QUIET, venv_bin
from tests.builders import STARTUP_TIMEOUT_S

# The Prefect server loops the tests' own API servers leave off: scheduling, late runs, work-pool health, cancellation
# and lease clean-up, automations, the event log, vacuuming. A test's flow runs need none of them (the task-run recorder
# and the event persister stay on); idle, they poll the database the whole time a server lives (measured: 2.4 against
# 1.4 CPU-s a minute). Each pytest process's temporary API and those of the `posttrain run`s it starts get this through
# the environment (tests/conftest.py), `prefect_server` here; the deployments' services run every loop (their
# schedule is tested).
UNUSED_PREFECT_SERVICES = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "SCHEDULER", "LATE_RUNS", "FOREMAN", "CANCELLATION_CLEANUP", "PAUSE_EXPIRATIONS", "REPOSSESSOR", "TRIGGERS",
    "EVENT_LOGGER", "CLEANUP_RECONCILER", "DB_VACUUM")}


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_group(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM a server's own process group (its workers included), then SIGKILL what is left."""
    signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    signal_group(pgid, signal.SIGKILL)  # the leader if it ignored SIGTERM, and workers that outlived it
    proc.wait(timeout=30)


def _started(proc: subprocess.Popen, ready, timeout: float, what: str, log: Path) -> None:
    if not wait_until(lambda: proc.poll() is not None or ready(), timeout, interval=0.1) or proc.poll() is not None:
        raise RuntimeError(f"{what} did not start within {timeout:.0f} s (exit code {proc.poll()}): "
                           f"{log.read_text(errors='replace')[-3000:]}")


# moto's server with buckets created before it accepts a connection: a restarted server (moto keeps its
# state in memory) then looks to a client like an S3 endpoint that came back, buckets and all.
_MOTO_WITH_BUCKETS = """
import sys
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import main
port, buckets = sys.argv[1], sys.argv[2:]
for name in buckets:
    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(name, "us-east-1")
main(["-H", "127.0.0.1", "-p", port])
"""


def start_moto(port: int, log: Path, buckets: tuple[str, ...] = ()) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:`port` in a process group of its own (stop it with
    `stop_group(proc, proc.pid)`), holding `buckets` from the start; returns once it accepts connections."""
    exe = Path(venv_bin("moto_server"))
    if buckets:
        cmd = [sys.executable, "-c", _MOTO_WITH_BUCKETS, str(port), *buckets]
    else:
        cmd = [*([str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]),
               "-H", "127.0.0.1", "-p", str(port)]
    with open(log, "ab") as out:  # the child keeps its own fd
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _started(proc, lambda: _accepts(port), 30, "moto_server", log)
    except BaseException:
        stop_group(proc, proc.pid)
        raise
    return proc


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """moto in server mode on 127.0.0.1:<free port>; yields its URL; stopped by its own process group on exit."""
    port = free_port()
    proc = start_moto(port, Path(log_dir) / "moto.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc, proc.pid)


@contextmanager
def mlflow_server(root: Path) -> Iterator[tuple[str, Path]]:
    """`mlflow server` (SQLite store and artifacts under `root`, job execution off) on 127.0.0.1:<free port>.

    Yields `(url, artifact_root)` once `/health` answers; its process group is stopped on exit.
    """
    root = Path(root)
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = root / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [venv_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{(root / 'server.db').resolve()}",
             "--artifacts-destination", str((root / "server-artifacts").resolve())],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=root)
    try:
        _started(proc, lambda: http_ok(url + "/health"), STARTUP_TIMEOUT_S, "mlflow server", log)
        yield url, root / "server-artifacts"
    finally:
        stop_group(proc, proc.pid)


def seed_prefect_home(home: Path, database: Path | None) -> None:
    """Put a copy of the migrated Prefect `database` in PREFECT_HOME `home` unless it holds one already: a server
    started there finds its schema at head and migrates nothing."""
    home.mkdir(parents=True, exist_ok=True)
    if database is not None and not (home / "prefect.db").exists():
        shutil.copyfile(database, home / "prefect.db")


@contextmanager
def prefect_server(root: Path, database: Path | None = None) -> Iterator[str]:
    """`prefect server start` (its own PREFECT_HOME and SQLite database under `root`, a copy of the migrated
    `database` when given, posttrain's server settings, no UI) on 127.0.0.1:<free port>. Yields its API URL once
    `/api/health` answers; its process group is stopped on exit. A `posttrain run` given it as PREFECT_API_URL starts
    no temporary API server of its own."""
    root = Path(root)
    seed_prefect_home(root, database)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({**PREFECT_SERVER_DEFAULTS, **QUIET, **UNUSED_PREFECT_SERVICES, "PREFECT_HOME": str(root),
                "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"})
    log = root / "server.log"
    url = f"http://127.0.0.1:{port}/api"
    with open(log, "wb") as out:
        proc = subprocess.Popen([venv_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=root)
    try:
        _started(proc, lambda: http_ok(url + "/health"), STARTUP_TIMEOUT_S, "prefect server", log)
        yield url
    finally:
        stop_group(proc, proc.pid)


def _ray_env(temp_dir: Path, token: str | None) -> dict[str, str]:
    """Environment of a test Ray cluster: loopback only, its own temp dir, token auth when `token` is given."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TMPDIR": str(temp_dir)}
    env.pop("RAY_ADDRESS", None)
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    return env


def _kill_leftovers(temp_dir: Path) -> None:
    """SIGKILL any process whose command line names this cluster's own temp dir (its raylet, GCS, workers)."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(temp_dir) in part for part in (proc.info["cmdline"] or [])):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


@contextmanager
def ray_head(temp_dir: Path, *, num_cpus: int = 4, token: str | None = None,
             dashboard_port: int | None = None) -> Iterator[str]:
    """`ray start --head --block` on 127.0.0.1:<free port>, as users start a cluster; yields its address.

    `dashboard_port`: the dashboard (and with it Ray's job server, `ray job submit`) on 127.0.0.1 at that
    port; None starts none. The head's PATH starts with this interpreter's directory, so a job's `python`
    is the project's venv. Stopped by its own process group (then any process left under its temp dir),
    never `ray stop`, which would stop every Ray on the machine.
    """
    port = free_port()
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir / "head.log"
    dashboard = (["--include-dashboard=false"] if dashboard_port is None else
                 ["--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                  # its agent (which runs the jobs) on a free port: the default 52365 may be another Ray's
                  "--dashboard-agent-listen-port", str(free_port())])
    cmd = [venv_bin("ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--num-cpus", str(num_cpus), "--num-gpus", "0", *dashboard, "--disable-usage-stats",
           "--object-store-memory", str(256 * 1024 * 1024), "--temp-dir", str(temp_dir / "ray")]
    env = _ray_env(temp_dir, token)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _started(proc, lambda: _accepts(port) and b"Ray runtime started" in log.read_bytes()
                 and (dashboard_port is None or _accepts(dashboard_port)), STARTUP_TIMEOUT_S, "ray head", log)
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(proc, proc.pid)
        _kill_leftovers(temp_dir)


def _launch_ray_nodes(temp_dir: Path, args: list[str], token: str | None, what: str) -> tuple[subprocess.Popen, str]:
    """`tests/ray_nodes.py` with `args` in a process (and session) of its own, its output in `temp_dir`/nodes.log;
    (the process, the head's address) once it has written the address. Stopped here only if it fails to start."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir / "nodes.log"
    address_file = temp_dir / "address"
    cmd = [sys.executable, str(Path(__file__).with_name("ray_nodes.py")), *args,
           "--address-file", str(address_file), "--temp-dir", str(temp_dir / "ray")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_ray_env(temp_dir, token),
                                start_new_session=True)
    try:
        _started(proc, address_file.is_file, STARTUP_TIMEOUT_S, what, log)
    except BaseException:
        stop_group(proc, proc.pid)
        _kill_leftovers(temp_dir)
        raise
    return proc, address_file.read_text().strip()


@contextmanager
def ray_nodes(temp_dir: Path, *, nodes: int = 2, cpus_per_node: int = 2, token: str | None = None) -> Iterator[str]:
    """A head and `nodes - 1` more Ray nodes on 127.0.0.1 (`ray.cluster_utils.Cluster` in a process of its own,
    `tests/ray_nodes.py`); yields the head's address. Stopped by its process id (it shuts its nodes down)."""
    proc, address = _launch_ray_nodes(temp_dir, ["--nodes", str(nodes), "--cpus-per-node", str(cpus_per_node)],
                                      token, "ray nodes")
    try:
        yield address
    finally:
        stop_group(proc, proc.pid)
        _kill_leftovers(temp_dir)


def start_shared_ray(temp_dir: Path, *, cpus: int, object_store_mb: int, system_config: dict,
                     owner_pid: int) -> tuple[int, str]:
    """The one local Ray (a head on 127.0.0.1, token auth off) that the pytest workers of a run share: a process of
    its own (`tests/ray_nodes.py`), which stops with SIGTERM (`stop_shared_ray`) or once `owner_pid`, the run's
    pytest process, is gone. Not stopped here: it outlives the worker that starts it. Returns (its process id, the
    head's address)."""
    import json

    proc, address = _launch_ray_nodes(
        temp_dir, ["--nodes", "1", "--cpus-per-node", str(cpus), "--object-store-mb", str(object_store_mb),
                   "--system-config", json.dumps(system_config), "--exit-with-pid", str(owner_pid)],
        None, "the shared ray")
    return proc.pid, address


def stop_shared_ray(pid: int, temp_dir: Path) -> None:
    """Stop what `start_shared_ray` started, by its process id, from any process (it need not be our child):
    SIGTERM (it shuts its node down), SIGKILL after 30 s, then any process left under its temp dir."""
    import psutil

    signal_group(pid, signal.SIGTERM)
    try:
        psutil.Process(pid).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        signal_group(pid, signal.SIGKILL)
    _kill_leftovers(temp_dir)
