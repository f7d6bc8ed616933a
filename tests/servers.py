"""Loopback services the tests start and stop by their own process ids: moto's S3 server, an MLflow server.

Fixtures in `conftest.py` wrap these (`moto_server` per test module, `mlflow_server` per test). Ports,
console scripts, polling and process-group signals are `infra.services`' (what `posttrain services` uses).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.services import _bin, _http_ok, _signal_group, _wait, free_port


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_group(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM a server's own process group (its workers included), then SIGKILL what is left."""
    _signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(pgid, signal.SIGKILL)  # the leader if it ignored SIGTERM, and workers that outlived it
    proc.wait(timeout=30)


def _started(proc: subprocess.Popen, ready, timeout: float, what: str, log: Path) -> None:
    if not _wait(lambda: proc.poll() is not None or ready(), timeout, interval=0.1) or proc.poll() is not None:
        raise RuntimeError(f"{what} did not start within {timeout:.0f} s (exit code {proc.poll()}): "
                           f"{log.read_text(errors='replace')[-3000:]}")


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """moto in server mode on 127.0.0.1:<free port>; yields its URL; stopped by its own process group on exit."""
    port = free_port()
    exe = Path(_bin("moto_server"))
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    log = Path(log_dir) / "moto.log"
    with open(log, "wb") as out:  # the child keeps its own fd
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _started(proc, lambda: _accepts(port), 30, "moto_server", log)
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
            [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{(root / 'server.db').resolve()}",
             "--artifacts-destination", str((root / "server-artifacts").resolve())],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=root)
    try:
        _started(proc, lambda: _http_ok(url + "/health"), 120, "mlflow server", log)
        yield url, root / "server-artifacts"
    finally:
        stop_group(proc, proc.pid)
