"""Local services on 127.0.0.1: a Prefect server, the `posttrain-process` work pool and a worker,
and an MLflow server (no job executor). `posttrain services up|down|status` and `make services`.

Everything lives under one state directory (`$POSTTRAIN_STATE_DIR`, default `.posttrain/services/`
under the working directory):

    prefect-home/                 PREFECT_HOME of the server and the worker (never ~/.prefect)
    mlflow.db  mlartifacts/       the MLflow server's SQLite store and artifact root
    <service>.pid.json            pid, process group, start time and command of each process
    <service>.log                 its stdout and stderr
    ports.json                    the ports chosen
    services.env                  `source` it: PREFECT_API_URL, MLFLOW_TRACKING_URI, POSTTRAIN_PROJECT_DIR

Each process is started with `start_new_session=True`, so it leads a process group of its own and
`down` stops exactly that group (SIGTERM, a second SIGTERM for the Prefect worker, whose first
signal only starts a graceful shutdown, then SIGKILL after a timeout). A pid file whose process is
gone, or whose pid now belongs to another process (start time differs), is only removed.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.processes import (
    HOST,
    free_port,
    group_alive,
    port_free,
    process_alive,
    process_start_ticks,
    signal_group,
    start_time,
    wait_until,
)
from infra.services.prefect_api import (
    AUTH_ENV,
    PREFECT_SERVER_DEFAULTS,
    auth_header,
    csrf_headers,
    http_ok,
    process_pool_template,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_DIR_ENV = "POSTTRAIN_STATE_DIR"
DEFAULT_STATE_DIR = Path(".posttrain") / "services"
PROJECT_DIR_ENV = "POSTTRAIN_PROJECT_DIR"
WORK_POOL = "posttrain-process"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}
PORT_ENV = {"prefect": "POSTTRAIN_PREFECT_PORT", "mlflow": "POSTTRAIN_MLFLOW_PORT"}
# Stop order: the worker before the server it talks to.
SERVICES = ("prefect-worker", "prefect-server", "mlflow")
PRIVATE_UMASK = 0o077  # files 0600, directories 0700
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0"}
class ServicesError(RuntimeError):
    """A service did not start, or the services are not up; the message says which and where its log is."""


def state_dir(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `$POSTTRAIN_STATE_DIR`, else `.posttrain/services` under the working directory (absolute)."""
    chosen = path or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return Path(chosen).expanduser().resolve()


def project_dir() -> Path:
    """The project the deployments run in: `$POSTTRAIN_PROJECT_DIR`, else this checkout."""
    return Path(os.environ.get(PROJECT_DIR_ENV) or REPO_ROOT).expanduser().resolve()


def venv_bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else whatever is on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def _choose_port(kind: str, requested: int | None) -> int:
    """An explicit port (0: any free one); else $POSTTRAIN_<KIND>_PORT; else the default if free, else any."""
    if requested is not None:
        return requested or free_port()
    if os.environ.get(PORT_ENV[kind]):
        return int(os.environ[PORT_ENV[kind]])
    return DEFAULT_PORTS[kind] if port_free(DEFAULT_PORTS[kind]) else free_port()


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600 from creation: never briefly world-readable)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


@dataclass
class Services:
    """The local services of one state directory."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike | None = None) -> Services:
        return cls(state_dir(path))

    # ---------------------------------------------------------------- files

    def pid_file(self, name: str) -> Path:
        return self.root / f"{name}.pid.json"

    def log_file(self, name: str) -> Path:
        return self.root / f"{name}.log"

    @property
    def env_file(self) -> Path:
        return self.root / "services.env"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect-home"

    def _record(self, name: str) -> dict | None:
        try:
            return json.loads(self.pid_file(name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def ports(self) -> dict[str, int]:
        try:
            return json.loads((self.root / "ports.json").read_text())
        except FileNotFoundError:
            return {}

    def urls(self, ports: Mapping[str, int] | None = None) -> dict[str, str]:
        ports = ports or self.ports()
        return {"PREFECT_API_URL": f"http://{HOST}:{ports['prefect']}/api",
                "PREFECT_UI_URL": f"http://{HOST}:{ports['prefect']}",
                "MLFLOW_TRACKING_URI": f"http://{HOST}:{ports['mlflow']}"}

    def env(self) -> dict[str, str]:
        """The variables of `services.env` (raises ServicesError when the services are not up)."""
        if not self.env_file.is_file() or not all(self.running().values()):
            down = [n for n, ok in self.running().items() if not ok]
            raise ServicesError(f"the local services are not up in {self.root} (not running: {', '.join(down)}); "
                                "start them with `posttrain services up` (or `make services`)")
        out = {}
        for line in self.env_file.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                key, _, value = line[len("export "):].partition("=")
                out[key] = shlex.split(value)[0] if value else ""
        return out

    @property
    def auth_file(self) -> Path:
        return self.root / "api_auth"

    def auth_string(self) -> str:
        """The Prefect API's `user:password` (basic auth): made once per state directory, kept in a 0600 file."""
        if self.auth_file.is_file():
            return self.auth_file.read_text().strip()
        import secrets

        auth = f"posttrain:{secrets.token_urlsafe(24)}"
        _write_private(self.auth_file, auth + "\n")
        return auth

    def running(self) -> dict[str, bool]:
        return {name: (rec := self._record(name)) is not None and process_alive(rec) for name in SERVICES}

    # ---------------------------------------------------------------- start

    def _base_env(self) -> dict[str, str]:
        env = {**PREFECT_SERVER_DEFAULTS, **os.environ, **QUIET}
        # Our own Prefect home and database; an inherited profile or API URL must not redirect them.
        for key in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_API_DATABASE_CONNECTION_URL",
                    "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_KEY"):
            env.pop(key, None)
        env["PREFECT_HOME"] = str(self.prefect_home)
        return env

    def _spawn(self, name: str, cmd: list[str], env: Mapping[str, str], cwd: Path) -> dict:
        # umask 077: what the service writes (databases, artifacts, the worker's flow runs) is its owner's only
        fd = os.open(self.log_file(name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.chmod(self.log_file(name), 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env), cwd=cwd, start_new_session=True, umask=PRIVATE_UMASK)
        started = start_time(proc.pid) or time.time()
        record = {"pid": proc.pid, "pgid": proc.pid, "create_time": started, "start_ticks": process_start_ticks(proc.pid),
                  "cmd": cmd}
        _write_private(self.pid_file(name), json.dumps(record, indent=1))
        return record

    def _await_health(self, name: str, url: str, timeout: float, auth: str | None = None) -> None:
        record = self._record(name)

        def ready() -> bool:
            if not process_alive(record):
                raise ServicesError(f"{name} exited during start-up; its log {self.log_file(name)} ends with:\n"
                                    f"{self._log_tail(name)}")
            return http_ok(url, auth)

        if not wait_until(ready, timeout, interval=0.5):
            raise ServicesError(f"{name} not healthy at {url} after {timeout:.0f} s; see {self.log_file(name)}:\n"
                                f"{self._log_tail(name)}")

    def _log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_file(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def _create_work_pool(self, env: Mapping[str, str]) -> None:
        """Create (or reset) the work pool with `process_pool_template()` as its base job template."""
        template = self.root / "process-pool-template.json"
        _write_private(template, json.dumps(process_pool_template(), indent=1))
        out = subprocess.run([venv_bin("prefect"), "--no-prompt", "work-pool", "create", WORK_POOL, "--type", "process",
                              "--base-job-template", str(template), "--overwrite"],
                             env=dict(env), capture_output=True, text=True, timeout=180, cwd=self.root,
                             check=False)
        if out.returncode != 0:
            raise ServicesError(f"`prefect work-pool create {WORK_POOL} --type process` failed "
                                f"({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")

    def up(self, *, prefect_port: int | None = None, mlflow_port: int | None = None, timeout: float = 240,
           worker_env: Mapping[str, str] | None = None, announce: Callable[[str], None] = print) -> dict[str, str]:
        """Start whatever is not running; return the variables written to `services.env`.

        Ports: explicit (0 picks a free one), else $POSTTRAIN_PREFECT_PORT / $POSTTRAIN_MLFLOW_PORT, else
        4200 / 5000 when free. `worker_env` is added to the worker's environment, which the flow runs inherit.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # logs, pid files, the MLflow store (no auth) and the API password: owner only
        state = self.running()
        if all(state.values()):
            announce(f"services already up in {self.root}")
            return self.env()
        if any(state.values()):  # a partial set (one crashed): restart all so ports and env agree
            announce("some services are down: restarting all")
            self.down(announce=announce)
        ports = {"prefect": _choose_port("prefect", prefect_port), "mlflow": _choose_port("mlflow", mlflow_port)}
        for kind, port in ports.items():
            if not port_free(port):
                raise ServicesError(f"port {port} on {HOST} is taken; free it or pick another with "
                                    f"{PORT_ENV[kind]}=<port>")
        _write_private(self.root / "ports.json", json.dumps(ports))
        urls = self.urls(ports)
        project = project_dir()
        base = self._base_env()
        try:
            # MLflow: SQLite store and artifact root in the state directory; no job executor.
            mlflow_env = {**base, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
            mlflow_env.pop("MLFLOW_TRACKING_URI", None)
            self._spawn("mlflow", [
                venv_bin("mlflow"), "server", "--host", HOST, "--port", str(ports["mlflow"]),
                "--backend-store-uri", "sqlite:///" + str(self.root / "mlflow.db"),
                "--artifacts-destination", str(self.root / "mlartifacts"), "--workers", "1",
            ], mlflow_env, self.root)
            # The API requires basic auth (a generated `user:password`, in 0600 files only), checks CSRF tokens
            # and takes browser requests from its own UI's origin only (Prefect's defaults: none of the three).
            auth = self.auth_string()
            server_env = {**base, "PREFECT_SERVER_API_AUTH_STRING": auth,
                          "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
                          "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": urls["PREFECT_UI_URL"]}
            self._spawn("prefect-server", [venv_bin("prefect"), "server", "start", "--host", HOST,
                                           "--port", str(ports["prefect"])], server_env, self.root)
            announce(f"waiting for the Prefect server on {urls['PREFECT_UI_URL']} ...")
            self._await_health("prefect-server", urls["PREFECT_API_URL"] + "/health", timeout, auth)
            client_env = {**base, "PREFECT_API_URL": urls["PREFECT_API_URL"], AUTH_ENV: auth}
            self._create_work_pool(client_env)
            wenv = {**client_env, "MLFLOW_TRACKING_URI": urls["MLFLOW_TRACKING_URI"], PROJECT_DIR_ENV: str(project),
                    **(worker_env or {})}
            self._spawn("prefect-worker", [venv_bin("prefect"), "worker", "start", "--pool", WORK_POOL,
                                           "--type", "process", "--name", f"posttrain-{socket.gethostname()}"],
                        wenv, project)
            announce(f"waiting for MLflow on {urls['MLFLOW_TRACKING_URI']} ...")
            self._await_health("mlflow", urls["MLFLOW_TRACKING_URI"] + "/health", timeout)
            if not wait_until(lambda: self._worker_polling(client_env), 60, interval=1.0):
                raise ServicesError(f"the Prefect worker is not polling {WORK_POOL}; see "
                                    f"{self.log_file('prefect-worker')}:\n{self._log_tail('prefect-worker')}")
        except BaseException:
            self.down(announce=lambda _: None)
            raise
        variables = {"PREFECT_API_URL": urls["PREFECT_API_URL"], AUTH_ENV: auth,
                     "MLFLOW_TRACKING_URI": urls["MLFLOW_TRACKING_URI"], PROJECT_DIR_ENV: str(project)}
        _write_private(self.env_file,
                       "# written by `posttrain services up` (mode 0600: it holds the API's password); use with: source "
                       + shlex.quote(str(self.env_file)) + "\n"
                       + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in variables.items()))
        announce(f"Prefect UI {urls['PREFECT_UI_URL']} · MLflow {urls['MLFLOW_TRACKING_URI']} · work pool {WORK_POOL}")
        announce(f"source {self.env_file}")
        return variables

    def _worker_polling(self, env: Mapping[str, str]) -> bool:
        if not process_alive(self._record("prefect-worker")):
            raise ServicesError(f"the Prefect worker exited; see {self.log_file('prefect-worker')}:\n"
                                f"{self._log_tail('prefect-worker')}")
        api, auth = env["PREFECT_API_URL"], env.get(AUTH_ENV)
        try:
            headers = {"Content-Type": "application/json", **auth_header(auth), **csrf_headers(api, auth)}
            request = urllib.request.Request(f"{api}/work_pools/{WORK_POOL}/workers/filter", data=b"{}", method="POST",
                                             headers=headers)
            with urllib.request.urlopen(request, timeout=5) as resp:
                return any(w.get("status") == "ONLINE" for w in json.loads(resp.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return False

    # ---------------------------------------------------------------- stop

    def _stop(self, name: str, timeout: float) -> str:
        record = self._record(name)
        if record is None:
            return f"{name}: not started"
        pid, pgid = record["pid"], record["pgid"]
        if not process_alive(record):
            self.pid_file(name).unlink(missing_ok=True)
            if start_time(pid) is None and group_alive(pgid):  # the leader is gone: stop what is left
                signal_group(pgid, signal.SIGKILL)
            return f"{name}: was not running (pid {pid}); removed its pid file"
        # The worker takes its first SIGTERM as "finish gracefully" and exits on the second.
        signals = [signal.SIGTERM, signal.SIGTERM] if name == "prefect-worker" else [signal.SIGTERM]
        how = "SIGTERM"
        for i, sig in enumerate(signals):
            signal_group(pgid, sig)
            how = "SIGTERM" if i == 0 else f"SIGTERM x{i + 1}"
            if wait_until(lambda: not process_alive(record), timeout / (len(signals) + 1) if i < len(signals) - 1 else timeout):
                break
        else:
            how = "SIGKILL"
            signal_group(pgid, signal.SIGKILL)
            wait_until(lambda: not process_alive(record), 10)
        # children of the group that outlived their leader (uvicorn/gunicorn workers, flow-run processes)
        if wait_until(lambda: not group_alive(pgid), 5) is False:
            signal_group(pgid, signal.SIGKILL)
            wait_until(lambda: not group_alive(pgid), 5)
        self.pid_file(name).unlink(missing_ok=True)
        return f"{name}: stopped (pid {pid}, {how})"

    def down(self, *, timeout: float = 30, announce: Callable[[str], None] = print) -> list[str]:
        """Stop exactly the processes recorded in the pid files; remove the pid files and services.env."""
        lines = [self._stop(name, timeout) for name in SERVICES]
        self.env_file.unlink(missing_ok=True)
        for line in lines:
            announce(line)
        return lines

    # ---------------------------------------------------------------- status

    def status(self) -> list[str]:
        ports = self.ports()
        where = {"prefect-server": f"http://{HOST}:{ports.get('prefect')}" if ports else "",
                 "prefect-worker": f"pool {WORK_POOL}",
                 "mlflow": f"http://{HOST}:{ports.get('mlflow')}" if ports else ""}
        lines = [f"state directory: {self.root}"]
        for name in SERVICES:
            record = self._record(name)
            if record is None:
                lines.append(f"  {name:15s} not started")
            elif process_alive(record):
                lines.append(f"  {name:15s} running  pid {record['pid']:<8d} {where[name]}  log {self.log_file(name)}")
            else:
                lines.append(f"  {name:15s} DEAD     pid {record['pid']:<8d} (stale pid file)  log {self.log_file(name)}")
        if self.env_file.is_file():
            lines.append(f"  env: source {self.env_file}")
        return lines
