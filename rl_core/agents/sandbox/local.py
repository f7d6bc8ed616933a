"""The local sandbox: one jail per episode, built from Linux namespaces and resource limits (`_jail.py`).

What it isolates, on Linux with user namespaces (or as root):
- **files**: the code sees a read-only root holding only the system folders (`/usr`, `/bin`, `/lib*`, `/sbin`,
  `/etc`) and Python's (the interpreter's prefix and the virtual environment), plus `/sandbox`, the episode's own
  tmpfs of `Limits.disk_bytes`. Home folders, the project, its artifacts and credentials files are not in it.
- **environment variables**: none inherited; PATH, HOME=/sandbox, TMPDIR=/sandbox, LANG and single-thread BLAS only.
- **network**: a network namespace of its own with no device but a loopback that is down: nothing to connect to.
- **processes**: a PID namespace of its own (it sees none of the host's processes); after each run every process
  it started is killed; a user of its own when started by root, else no capabilities; no new privileges.
- **resources** per run: wall time (killed at `Limits.seconds`), CPU time, address space, processes, file size,
  open files; its output is cut at `Limits.output_bytes` per stream.

What it does not isolate: the kernel (a kernel exploit escapes it, as from any process: use `ContainerSandbox` with
a hardened runtime such as gVisor for hostile code), CPU time shared with the host's other work, and reads of the
system folders it shows.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from rl_core.agents.sandbox.base import Limits, RunResult, Sandbox, SandboxError, inside, writable

JAIL = Path(__file__).with_name("_jail.py")
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8",
       "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
MOUNT_POINT = "posttrain-sandbox-"
START_SECONDS = 30.0
MARGIN_SECONDS = 10.0  # beyond a run's own limit, before the jail itself counts as hung


def _binds() -> list[str]:
    """The folders the jail shows read-only: the system's, and Python's where they are outside them, each at its
    path as Python names it and at its real path (a virtual environment is found by the path of its `python`)."""
    folders = [p for p in SYSTEM_FOLDERS if os.path.lexists(p)]
    prefixes = (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)
    for path in sorted({f(p) for p in prefixes for f in (os.path.abspath, os.path.realpath)}, key=len):
        if not any(path == f or path.startswith(f + "/") for f in folders):  # one inside another is shown with it
            folders.append(path)
    return folders


class LocalSandbox(Sandbox):
    """An episode's jail on this machine (Linux only); see the module's docstring for what it isolates."""

    def __init__(self, limits: Limits | None = None):
        super().__init__(limits)
        self.python = os.path.abspath(sys.executable)  # as the jail shows it: no `..` through folders it lacks
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def start(self) -> LocalSandbox:
        if self._proc is not None:
            return self
        if not sys.platform.startswith("linux"):
            raise SandboxError("the local sandbox needs Linux namespaces; use ContainerSandbox on this machine")
        _remove_stale_mount_points()
        # only a mount point, empty on the host; named by this process, so that another can remove it if this one dies
        root = tempfile.mkdtemp(prefix=f"{MOUNT_POINT}{os.getpid()}-")
        limits = self.limits
        cfg = {"root": root, "binds": _binds(), "python": self.python, "env": ENV, "disk_bytes": limits.disk_bytes,
               "limits": {"cpu_seconds": max(1, int(limits.seconds + 0.999)), "memory_bytes": limits.memory_bytes,
                          "processes": limits.processes, "file_bytes": limits.file_bytes,
                          "output_bytes": limits.output_bytes}}
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), json.dumps(cfg)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/",
                                      start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill, self._proc, root)
        first = self._reply(START_SECONDS)
        if not first.get("ready"):
            self.stop()
            raise SandboxError(f"the local sandbox cannot start: {first.get('error', first)}. It needs Linux user "
                               "namespaces (sysctl user.max_user_namespaces > 0, and kernel.apparmor_restrict_"
                               "unprivileged_userns=0 where AppArmor restricts them) or root; or use ContainerSandbox")
        return self

    def run(self, argv: Sequence[str], *, stdin: bytes = b"", seconds: float | None = None) -> RunResult:
        if not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv):
            raise SandboxError(f"a command is a non-empty list of strings, got {argv!r}")
        seconds = float(seconds or self.limits.seconds)
        began = time.perf_counter()
        reply = self._request({"op": "run", "argv": list(argv), "timeout": seconds,
                               "stdin": base64.b64encode(stdin).decode()}, seconds)
        return _result(reply, time.perf_counter() - began if not reply["timed_out"] else seconds)

    def read(self, path: str, limit: int | None = None) -> bytes:
        limit = int(limit or self.limits.file_bytes)
        reply = self._request({"op": "read", "path": inside(path), "limit": limit}, 10.0)
        result = _result(reply, 0.0)
        if not result.ok:
            raise SandboxError(f"cannot read {path!r} in the sandbox: {_last_line(result.stderr)}")
        return base64.b64decode(reply["stdout"])

    def write(self, path: str, data: bytes) -> None:
        reply = self._request({"op": "write", "path": writable(path, data, self.limits),
                               "stdin": base64.b64encode(data).decode()}, 10.0)
        result = _result(reply, 0.0)
        if not result.ok:
            raise SandboxError(f"cannot write {path!r} in the sandbox: {_last_line(result.stderr)}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.write(b'{"op": "stop"}\n')
            proc.stdin.flush()
            proc.wait(timeout=2)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        if self._finalizer is not None:
            self._finalizer()

    # the jail's pipe
    def _request(self, request: dict, seconds: float) -> dict:
        with self._lock:
            if self._proc is None:
                raise SandboxError("the sandbox is not started (call start() first)")
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                self.stop()
                raise SandboxError(f"the sandbox has stopped ({exc})") from None
            return self._reply(seconds + MARGIN_SECONDS)

    def _reply(self, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            chunk = os.read(fd, 1 << 20) if ready else b""
            if not chunk:
                why = "did not answer in time" if not ready else "stopped"
                err = self._proc.stderr.read1(4096).decode(errors="replace") if why == "stopped" else ""
                self.stop()
                raise SandboxError(f"the sandbox {why}{': ' + err.strip() if err else ''}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)


def _last_line(text: str) -> str:
    """What a failed read or write said last (Python's error line), or that it said nothing."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no error message"


def _result(reply: dict, seconds: float) -> RunResult:
    return RunResult(reply["exit_code"], base64.b64decode(reply["stdout"]).decode(errors="replace"),
                     base64.b64decode(reply["stderr"]).decode(errors="replace"), reply["timed_out"],
                     reply["stdout_cut"], reply["stderr_cut"], seconds)


def _remove_stale_mount_points() -> None:
    """Remove the empty mount points of processes that died without stopping their sandboxes (killed actors)."""
    for path in Path(tempfile.gettempdir()).glob(f"{MOUNT_POINT}*-*"):
        pid = path.name[len(MOUNT_POINT):].partition("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                path.rmdir()  # only an empty folder: anything else named like it is left alone
            except OSError:
                pass


def _kill(proc: subprocess.Popen, root: str) -> None:
    """Kill the jail's processes (its PID namespace goes with its first process) and remove the mount point."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
    try:
        os.rmdir(root)
    except OSError:
        pass


_PROBLEM: list[str | None] = []


def local_sandbox_problem() -> str | None:
    """Why the local sandbox cannot run on this machine (None: it can), found once per process by starting one."""
    if not _PROBLEM:
        try:
            with LocalSandbox(Limits(seconds=5)) as sandbox:
                result = sandbox.run(["true"])
            _PROBLEM.append(None if result.ok else f"a command in it failed: {result.text()}")
        except SandboxError as exc:
            _PROBLEM.append(str(exc))
    return _PROBLEM[0]
