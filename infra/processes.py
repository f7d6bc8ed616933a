"""Processes and ports on this machine: whether a recorded process is still the one started (not a reused pid),
its process group signalled and awaited, free TCP ports on 127.0.0.1, and the CPU threads of each process role.

Threads per role (docs/benchmarks.md, the threads table): the driver uses `DRIVER_THREADS`; a trainer rank, a
rollout engine and a teacher use `cluster.cpus_per_worker` / `cpus_per_engine` (what Ray reserves for them); a
reward worker one. Every one of them runs OpenMP with `OPENMP_ENV` (idle threads sleep instead of spinning), set by
`posttrain` before torch loads and passed to the Ray actors in their runtime_env (`infra.cluster.ray_connect`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

HOST = "127.0.0.1"
# OpenMP's default lets each idle thread of torch's pool busy-wait after every parallel region. Where the driver,
# trainer ranks, engines and reward workers share cores, the spinning takes the cores the others are waiting for
# (a tiny-model generate next to one busy process: 1.5 s alone, 42 s spinning, 2.5 s passive). Read by the OpenMP
# runtime when torch loads it: set before `import torch`, in the environment of every process started after.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# The driver holds no model: its tensor work (annotate, the gate, the rewards' bookkeeping) is small, and its
# threads would only compete with the actors' on the same cores.
DRIVER_THREADS = 1


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def child_listening_on(port: int) -> int | None:
    """The pid of this process's child that listens on TCP `port`; None when there is none."""
    import psutil

    for child in psutil.Process().children():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in child.net_connections("tcp")):
                return child.pid
        except psutil.Error:
            continue
    return None


def start_time(pid: int) -> float | None:
    """The process's start time (psutil), None when it is gone or a zombie."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _reap(pid: int) -> None:
    try:  # when the caller is the parent (tests), collect the exit status so no zombie lingers
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def process_start_ticks(pid: int) -> int | None:
    """The process's start in clock ticks since boot (/proc/<pid>/stat, field 22): unlike a wall-clock start
    time it does not move when the system clock is stepped. None where /proc has no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    return None if fields[0] == "Z" else int(fields[19])


def process_alive(record: Mapping) -> bool:
    """True while the recorded process is running and is still the one we started (not a reused pid)."""
    _reap(record["pid"])
    if record.get("start_ticks") is not None and Path("/proc/self/stat").exists():
        return process_start_ticks(record["pid"]) == record["start_ticks"]
    started = start_time(record["pid"])
    return started is not None and abs(started - record["create_time"]) < 1.0


def group_alive(pgid: int) -> bool:
    import psutil

    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.info["pid"]) == pgid:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def passive_openmp() -> None:
    """`OPENMP_ENV` in this process's environment where unset (a user's own value wins): in effect for this process
    when called before torch is imported, and for every process started from it."""
    for key, value in OPENMP_ENV.items():
        os.environ.setdefault(key, value)


def use_threads(threads: int) -> None:
    """This process's torch intra-op threads (a role's CPUs; at least one)."""
    import torch

    torch.set_num_threads(max(int(threads), 1))
