"""What one Prefect task run costs, whatever the task does: the floor under the pipeline's overhead.

Runs a flow against Prefect's temporary API server (as `posttrain run` does) that calls a no-op task
(`cache_policy=NO_CACHE`, retries set, as the pipeline's phases are) many times, and prints:

- driver ms / task: wall time of one call in the flow's process (task run created, states set, the
  events queued);
- API server CPU ms / task: CPU time the temporary server spends per task run (it receives each
  run's state events and records them, which is what the UI shows), read from /proc for its pid.

Once with Prefect's own server settings (the task-run recorder writes every event in its own
transaction) and once with those posttrain starts its servers with (infra.services.prefect_api.PREFECT_SERVER_DEFAULTS:
batches of up to 100, at least once a second), each row in a process of its own.
The pipeline runs six such tasks a step (rollout, reward, annotate, validate, train, sync).

    python benchmarks/bench_prefect_task.py [--calls 600]
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(calls: int) -> tuple[float, float]:
    """(driver seconds, API server CPU seconds) per task run, against a temporary server started here."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client

    from infra.processes import child_listening_on

    logging.getLogger("prefect.task_runs").setLevel("WARNING")

    @task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
    def noop(x: int) -> int:
        return x

    @flow
    def run_calls(n: int) -> tuple[float, float]:
        for _ in range(20):  # warm-up
            noop(1)
        time.sleep(2)  # let the server catch up on the warm-up's events
        server = child_listening_on(get_client(sync_client=True).api_url.port)  # the temporary API server's pid
        cpu0, t0 = cpu_seconds(server), time.perf_counter()
        for _ in range(n):
            noop(1)
        wall = time.perf_counter() - t0
        time.sleep(5)  # the server records the events after the calls return
        return wall / n, (cpu_seconds(server) - cpu0) / n

    return run_calls(calls)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not os.path.exists("/proc/self/stat"):
        print("(needs /proc to read the server's CPU time: not run)")
        return 0
    if args.child:  # one measurement, in a process of its own: the server reads its settings when it starts
        print(*measure(args.calls))
        return 0

    sys.path.insert(0, str(REPO))
    from report import write_section  # benchmarks/ is this script's sys.path[0]

    from infra.services.prefect_api import PREFECT_SERVER_DEFAULTS

    variants = {"Prefect's defaults": {}, "posttrain's server settings": PREFECT_SERVER_DEFAULTS}
    print("server settings | driver ms / task | API server CPU ms / task | per step (6 tasks): driver ms | "
          "server CPU ms")
    print("--- | --- | --- | --- | ---")
    rows = []
    for name, settings in variants.items():
        env = {**{k: v for k, v in os.environ.items() if k not in PREFECT_SERVER_DEFAULTS}, **settings}
        out = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)], env=env, check=True,
                             capture_output=True, text=True)
        driver, server = map(float, out.stdout.split()[-2:])
        rows.append([name, f"{1e3 * driver:.2f}", f"{1e3 * server:.2f}", f"{6e3 * driver:.1f}", f"{6e3 * server:.1f}"])
        print(" | ".join(rows[-1]))
    note = (f"No-op task, NO_CACHE, retries=2; {args.calls} calls; the server's CPU includes its other work in that "
            "window, which is idle here.")
    print(f"({note})")
    write_section("prefect-task", ["API server settings", "driver ms / task", "API server CPU ms / task",
                                   "per step (6 tasks): driver ms", "server CPU ms"], rows, [note])
    return 0


if __name__ == "__main__":
    sys.exit(main())
