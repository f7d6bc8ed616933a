"""Loopback services the tests start and stop by their own process ids: moto's S3 server, an MLflow server.

Fixtures in `conftest.py` wrap these (`moto_server` per test module, `mlflow_server` per test).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, pgid: int) -> None:
    """SIGTERM a server's own process group (its workers included), then SIGKILL what is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=30)
    try:  # workers of the group that outlived the leader
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """moto in server mode on 127.0.0.1:<free port>; yields its URL; stopped by its own pid on exit."""
    port = free_port()
    exe = BIN / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    with open(Path(log_dir) / "moto.log", "wb") as log_file:  # the child keeps its own fd
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=log_file,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start within 30 s") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def mlflow_server(root: Path) -> Iterator[tuple[str, Path]]:
    """`mlflow server` (SQLite store and artifacts under `root`, job execution off) on 127.0.0.1:<free port>.

    Yields `(url, artifact_root)` once `/health` answers; its process group is stopped on exit.
    """
    root = Path(root)
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = root / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{(root / 'server.db').resolve()}",
             "--artifacts-destination", str((root / "server-artifacts").resolve())],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=root)
    pgid = proc.pid  # start_new_session: the server leads a process group of its own
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy in 120 s: {log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, root / "server-artifacts"
    finally:
        stop_group(proc, pgid)
