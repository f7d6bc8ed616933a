"""Where a command's CPU goes, by kind of process: the test suite's, above all.

    python3 tools/suite_profile.py [--interval 0.5] [--top 30] [--tsv FILE] -- make test

Runs the command and, every `--interval` seconds until it exits, reads every process's CPU time (user + system)
and command line from /proc. Each process that started after the profiler did is counted once, by its last
reading, under its kind (`kind`): a Ray actor by its class (`ray::PolicyWorker`), a Ray worker that never named an
actor, a pytest-xdist worker, `python -m X`, `posttrain X`, a script by its file name. The table lists the kinds by
CPU-seconds, with the number of processes of each; the machine's own CPU count over the same time (/proc/stat)
says how much the table left out: processes shorter than the interval, and each process's last interval.

A 2-core machine whose suite is CPU-bound takes about (the suite's CPU-seconds) / 2 of wall time, so the table says
what a shorter `make test` has to take away. Linux only; standard library only. The command's exit status is the
profiler's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

TICKS = os.sysconf("SC_CLK_TCK")
XDIST_WORKER = "import sys;exec(eval(sys.stdin.readline()))"
COMMANDS = ("posttrain", "dvc", "prefect", "mlflow", "ray")  # console scripts named with their subcommand
UNNAMED = ("(no command line)", "Ray worker (no actor)", "ray::IDLE")  # kinds a later command line may name


@dataclass
class Seen:
    cmdline: str
    cpu_s: float


def kind(cmdline: str) -> str:
    """The kind a command line is counted under (module docstring)."""
    words = cmdline.split()
    if not words:
        return "(no command line)"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]
    if any(w.endswith(("/default_worker.py", "/setup_worker.py")) for w in words[1:3]):
        return "Ray worker (no actor)"
    exe = os.path.basename(words[0])
    if XDIST_WORKER in cmdline:
        return "pytest worker"
    if exe in COMMANDS:
        return " ".join([exe, *words[1:2]])
    if exe.startswith("python"):
        args = [w for w in words[1:] if w not in ("-u", "-B", "-E", "-s", "-I")]
        if args[:1] == ["-m"] and len(args) > 1:
            return "python -m " + args[1]
        if args[:1] == ["-c"]:
            return "python -c " + " ".join(args[1:])[:40]
        if args:
            script = os.path.basename(args[0])
            return " ".join([script, *args[1:2]]) if script in COMMANDS else script
    return exe


def _read(pid: str) -> tuple[int, float, str] | None:
    """(start time in ticks since boot, CPU seconds, command line) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS, cmdline


def _machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return (user + nice + system) / TICKS


def _boot_ticks() -> int:
    """Ticks since boot now: a process whose start time is later started after this call."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * TICKS)


def sample(seen: dict[tuple[str, int], Seen], since: int) -> None:
    """One reading of every process that started at or after `since` (ticks since boot). A command line is kept
    from the first reading that names something other than an idle Ray worker (Ray renames its workers)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        read = _read(pid)
        if read is None or read[0] < since:
            continue
        start, cpu_s, cmdline = read
        known = seen.get((pid, start))
        if known is None:
            seen[(pid, start)] = Seen(cmdline, cpu_s)
            continue
        known.cpu_s = cpu_s
        if cmdline and kind(known.cmdline) in UNNAMED:
            known.cmdline = cmdline


def table(seen: dict[tuple[str, int], Seen], top: int) -> list[tuple[str, int, float]]:
    """(kind, processes, CPU seconds) of the `top` kinds by CPU, the rest summed into one last row."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for s in seen.values():
        row = by_kind[kind(s.cmdline)]
        row[0] += 1
        row[1] += s.cpu_s
    rows = sorted(((k, int(n), cpu) for k, (n, cpu) in by_kind.items()), key=lambda r: -r[2])
    if len(rows) > top:
        rest = rows[top:]
        rows = [*rows[:top], (f"({len(rest)} other kinds)", sum(r[1] for r in rest), sum(r[2] for r in rest))]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between readings (default 0.5)")
    parser.add_argument("--top", type=int, default=30, help="kinds listed (default 30; the rest in one row)")
    parser.add_argument("--tsv", help="also write one line per process: kind, CPU seconds, command line")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: tools/suite_profile.py -- make test")
    seen: dict[tuple[str, int], Seen] = {}
    since, cpu0, wall0 = _boot_ticks(), _machine_cpu_s(), time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, since)
        time.sleep(args.interval)
    sample(seen, since)
    wall, machine = time.monotonic() - wall0, _machine_cpu_s() - cpu0
    rows = table(seen, args.top)
    counted = sum(r[2] for r in rows)
    print(f"\n{' '.join(command)[:80]}: exit {proc.returncode}, {wall:.0f} s wall, {machine:.0f} CPU-s on the machine "
          f"({os.cpu_count()} CPUs), {counted:.0f} CPU-s counted in {len(seen)} processes")
    print(f"{'CPU-s':>8} {'share':>6} {'procs':>6} {'CPU-s/proc':>10}  kind")
    for name, n, cpu in rows:
        print(f"{cpu:8.1f} {cpu / max(counted, 1e-9):6.1%} {n:6d} {cpu / n:10.2f}  {name}")
    if args.tsv:
        with open(args.tsv, "w") as f:
            f.writelines(f"{kind(s.cmdline)}\t{s.cpu_s:.2f}\t{s.cmdline}\n"
                         for s in sorted(seen.values(), key=lambda s: -s.cpu_s))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
