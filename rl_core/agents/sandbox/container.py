"""The container sandbox: one container per episode, through the `docker` or `podman` command line.

The container runs the image's Python (`python3`) as user 65534 with no network (`--network none`), no capability,
no new privileges, a read-only root and the episode's directory `/sandbox` as a tmpfs of `Limits.disk_bytes`;
memory (swap included), processes and file size capped by the runtime, and the time of each run by `timeout -s
KILL` inside it (the image needs coreutils' `timeout`, as the python images have). No variable of the host is
passed in. It isolates what the runtime does: with runc a container shares the host's kernel, as the local sandbox
does; with gVisor (`runtime=docker`, `--runtime=runsc` set up in the daemon) or a VM runtime it does not.
"""

from __future__ import annotations

import base64
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

from rl_core.agents.sandbox._jail import collect, feed
from rl_core.agents.sandbox.base import Limits, RunResult, Sandbox, SandboxError, inside, writable

ENV = ("HOME=/sandbox", "TMPDIR=/sandbox", "LANG=C.UTF-8", "OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=1",
       "PYTHONDONTWRITEBYTECODE=1")


def container_runtime() -> str | None:
    """`docker` or `podman` when one is on PATH and its daemon answers; None otherwise."""
    for name in ("docker", "podman"):
        path = shutil.which(name)
        if path is None:
            continue
        try:
            if subprocess.run([path, "info"], capture_output=True, timeout=20, check=False).returncode == 0:
                return path
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


class ContainerSandbox(Sandbox):
    """An episode's container (see the module's docstring). `image` must hold Python 3 and coreutils."""

    def __init__(self, limits: Limits | None = None, *, image: str = "python:3.11-slim", runtime: str | None = None):
        super().__init__(limits)
        self.image = image
        self.runtime = runtime
        self.name: str | None = None
        self._lock = threading.Lock()

    def start(self) -> ContainerSandbox:
        if self.name is not None:
            return self
        self.runtime = self.runtime or container_runtime()
        if self.runtime is None:
            raise SandboxError("no container runtime answers here (docker or podman, with its daemon running); "
                               "use LocalSandbox")
        limits, name = self.limits, f"posttrain-sandbox-{secrets.token_hex(8)}"
        command = [self.runtime, "run", "--detach", "--rm", "--name", name, "--network", "none",
                   "--user", "65534:65534", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                   "--read-only", "--tmpfs", f"/sandbox:rw,size={limits.disk_bytes},mode=1777",
                   "--workdir", "/sandbox", "--memory", str(limits.memory_bytes),
                   "--memory-swap", str(limits.memory_bytes), "--pids-limit", str(limits.processes),
                   "--ulimit", f"fsize={limits.file_bytes}", "--ulimit", "nofile=256", "--cpus", "1"]
        for item in ENV:
            command += ["--env", item]
        started = subprocess.run(command + [self.image, "sleep", "infinity"], capture_output=True, text=True,
                                 check=False, timeout=300)
        if started.returncode != 0:
            raise SandboxError(f"the container sandbox cannot start ({self.image}): {started.stderr.strip()[-500:]}")
        self.name = name
        return self

    def run(self, argv: Sequence[str], *, stdin: bytes = b"", seconds: float | None = None) -> RunResult:
        began = time.perf_counter()
        seconds = float(seconds or self.limits.seconds)
        reply = self._exec(argv, stdin, seconds, self.limits.output_bytes)
        timed_out = reply["exit_code"] in (None, 124, 137, -9) and time.perf_counter() - began >= seconds
        return RunResult(None if timed_out else reply["exit_code"],
                         base64.b64decode(reply["stdout"]).decode(errors="replace"),
                         base64.b64decode(reply["stderr"]).decode(errors="replace"), timed_out,
                         reply["stdout_cut"], reply["stderr_cut"], time.perf_counter() - began)

    def _exec(self, argv: Sequence[str], stdin: bytes, seconds: float, cap: int) -> dict:
        """Run `argv` in the container (killed at `seconds`), then every process it left; `_jail.collect`'s reply."""
        if self.name is None:
            raise SandboxError("the sandbox is not started (call start() first)")
        command = [self.runtime, "exec", "--interactive", self.name, "timeout", "-s", "KILL", f"{seconds:g}", *argv]
        with self._lock:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            feeder = threading.Thread(target=feed, args=(proc.stdin.fileno(), stdin), daemon=True)
            feeder.start()
            reply = collect(proc.stdout.fileno(), proc.stderr.fileno(), proc.poll, time.monotonic() + seconds + 5,
                            cap)
            proc.kill()
            proc.wait()
            feeder.join()
            proc.stdout.close()
            proc.stderr.close()
            # what the command left running goes with it: every process of the sandbox's user but the container's first
            subprocess.run([self.runtime, "exec", self.name, "kill", "-9", "-1"], capture_output=True, timeout=30,
                           check=False)
        return reply

    def read(self, path: str, limit: int | None = None) -> bytes:
        limit = int(limit or self.limits.file_bytes)
        reply = self._exec(["head", "-c", str(limit), "--", inside(path)], b"", 10.0, limit)
        if reply["exit_code"] != 0:
            error = base64.b64decode(reply["stderr"]).decode(errors="replace").strip()[-300:]
            raise SandboxError(f"cannot read {path!r} in the sandbox: {error}")
        return base64.b64decode(reply["stdout"])

    def write(self, path: str, data: bytes) -> None:
        result = self.run(["sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh",
                           writable(path, data, self.limits)],
                          stdin=data, seconds=10)
        if not result.ok:
            raise SandboxError(f"cannot write {path!r} in the sandbox: {result.stderr.strip()[-300:]}")

    def stop(self) -> None:
        name, self.name = self.name, None
        if name is not None:
            subprocess.run([self.runtime, "rm", "--force", name], capture_output=True, timeout=60, check=False)
