"""The sandbox protocol: `Limits`, `RunResult`, the `Sandbox` base every backend fills in, and `python_tool`."""

from __future__ import annotations

import posixpath
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

MAX_CODE_CHARS = 64 * 1024  # a tool call's body is at most this long (rl_core.agents.tools.MAX_CALL_CHARS)


class SandboxError(RuntimeError):
    """The sandbox itself failed (it cannot start, it died, a path leaves its directory): not the code's failure."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. `seconds` is wall time (the run is killed at it) and CPU time (the kernel's limit);
    `memory_bytes` the address space of each process; `processes` how many it may have at once; `file_bytes` the
    largest file it may write, `disk_bytes` all of its directory's files together; `output_bytes` what is kept of
    each of stdout and stderr (the rest is counted, not kept)."""

    seconds: float = 10.0
    memory_bytes: int = 1 << 30
    processes: int = 32
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    output_bytes: int = 16 << 10

    def __post_init__(self) -> None:
        for name in ("seconds", "memory_bytes", "processes", "file_bytes", "disk_bytes", "output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class RunResult:
    """One run: its exit code (None when killed at the time limit; negative: the signal that ended it), output
    (decoded, each stream at most `Limits.output_bytes`) and how many bytes of each were cut."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_cut: int = 0
    stderr_cut: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """What a tool answers the model: the output, then what went wrong, if anything."""
        parts = [self.stdout + (f"\n[{self.stdout_cut} more bytes of output cut]" if self.stdout_cut else "")]
        if self.stderr:
            parts.append(self.stderr + (f"\n[{self.stderr_cut} more bytes cut]" if self.stderr_cut else ""))
        if self.timed_out:
            parts.append(f"error: the run was stopped at its time limit ({self.seconds:.0f} s)")
        elif self.exit_code == -signal.SIGXCPU:
            parts.append("error: the run was stopped at its CPU time limit")
        elif self.exit_code is not None and self.exit_code < 0:
            parts.append(f"error: the run was killed by {_signal_name(-self.exit_code)}")
        elif self.exit_code:
            parts.append(f"error: exit code {self.exit_code}")
        return "\n".join(p for p in parts if p).strip()


class Sandbox:
    """One episode's sandbox (a backend subclasses it). `start` before anything, `stop` at the end (it is safe to
    call twice, and a sandbox is a context manager)."""

    python: str = "python3"  # the sandbox's Python (a backend names its own)

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()

    # what a backend defines
    def start(self) -> Self:
        raise NotImplementedError

    def run(self, argv: Sequence[str], *, stdin: bytes = b"", seconds: float | None = None) -> RunResult:
        """Run `argv` (argv[0] a path or a name on the sandbox's PATH) in the episode's directory; `seconds` replaces
        `Limits.seconds` as this run's wall-time limit (its CPU-time limit stays `Limits.seconds`)."""
        raise NotImplementedError

    def read(self, path: str, limit: int | None = None) -> bytes:
        """The first `limit` bytes (default `Limits.file_bytes`) of file `path` of the episode's directory."""
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        """Write `data` to file `path` of the episode's directory (at most `Limits.file_bytes`)."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    # on top of them
    def run_python(self, code: str, *, seconds: float | None = None) -> RunResult:
        """Run `code` with the sandbox's Python, isolated mode (no PYTHON* variables, no user site, no current
        directory on the path)."""
        if len(code) > MAX_CODE_CHARS:
            return RunResult(None, "", f"error: the code has {len(code)} characters; at most {MAX_CODE_CHARS}")
        return self.run([self.python, "-I", "-c", code], seconds=seconds)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def writable(path: str, data: bytes, limits: Limits) -> str:
    """`inside(path)`, once `data` is known to fit `limits.file_bytes` (SandboxError naming the sizes else)."""
    if len(data) > limits.file_bytes:
        raise SandboxError(f"{len(data)} bytes for {path!r}: over Limits.file_bytes ({limits.file_bytes})")
    return inside(path)


def inside(path: str) -> str:
    """`path` as a path relative to the episode's directory; SandboxError for one that is absolute or climbs out."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxError(f"a sandbox path is a non-empty relative path, got {path!r}")
    clean = posixpath.normpath(path)
    if posixpath.isabs(clean) or clean == ".." or clean.startswith("../"):
        raise SandboxError(f"{path!r} is outside the episode's directory; paths are relative to it")
    return clean


def python_tool(sandbox: Sandbox) -> Callable[[str], str]:
    """The built-in `python` tool: it runs the model's code in `sandbox` and answers with its output (and what went
    wrong: an exception's traceback, the time limit, the memory limit)."""

    def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: a Python program; print the values you need
        """
        return sandbox.run_python(code).text() or "(no output)"

    return python
