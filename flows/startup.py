"""Where start-up goes: seconds from the process's start to each mark of a run, up to its first rollout.

`mark(name)` records the process's age at a point of the start-up; the first step trained in this
process logs them as `perf/startup/<name>_s` (`benchmarks/bench_pipeline.py` prints them). The age is
taken on the boot clock against the process's start in /proc, so the interpreter's own start and the
imports count, and a stepped wall clock changes nothing; elsewhere it counts from this module's import.
"""

from __future__ import annotations

import os
import time

from infra.processes import process_start_ticks

MARKS: dict[str, float] = {}
_taken = False
_TICKS = process_start_ticks(os.getpid()) if hasattr(time, "CLOCK_BOOTTIME") else None
_IMPORTED = time.monotonic()


def age() -> float:
    """Seconds since this process started."""
    if _TICKS is not None:
        return time.clock_gettime(time.CLOCK_BOOTTIME) - _TICKS / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - _IMPORTED


def mark(name: str) -> None:
    """Record the process's age at `name` (the first time only: a restart or a second run does not move it)."""
    if not _taken:
        MARKS.setdefault(name, age())


def take() -> dict[str, float]:
    """The marks as metrics (`perf/startup/<name>_s`), once per process: later calls return nothing."""
    global _taken
    out = {} if _taken else {f"perf/startup/{name}_s": value for name, value in MARKS.items()}
    _taken = True
    return out
