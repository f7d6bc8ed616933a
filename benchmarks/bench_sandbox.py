"""The local sandbox's costs (rl_core/agents/sandbox): what one episode pays to start and stop its jail, and what a
run in it costs next to the same command run directly on the host.

Each figure is the median of `--repeats` tries, in this process, one after another:
- start + stop: `LocalSandbox().start()` then `.stop()` (the jail's process, its namespaces and mounts, and its end);
- a command: `true` run in a started sandbox, and by `subprocess.run` on the host;
- Python: `print(6 * 7)` by the sandbox's Python (`run_python`, isolated mode), and by `python -I -c` on the host;
- the code tool: `python_tool(sandbox)("print(123+456+789)")`, what the code example's episodes call.

    python benchmarks/bench_sandbox.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from report import write_section  # benchmarks/ is this script's sys.path[0]

from rl_core.agents.sandbox import LocalSandbox, python_tool


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    rows = [["start + stop", f"{median_ms(lambda: LocalSandbox().start().stop(), args.repeats):.1f}", "-"]]
    with LocalSandbox() as box:
        assert box.run(["true"]).ok and box.run_python("print(6 * 7)").stdout == "42\n"
        rows.append(["`true`", f"{median_ms(lambda: box.run(['true']), args.repeats):.1f}",
                     f"{median_ms(lambda: subprocess.run(['true'], check=True), args.repeats):.1f}"])
        host = [sys.executable, "-I", "-c", "print(6 * 7)"]
        rows.append(["Python `print(6 * 7)`", f"{median_ms(lambda: box.run_python('print(6 * 7)'), args.repeats):.1f}",
                     f"{median_ms(lambda: subprocess.run(host, check=True, capture_output=True), args.repeats):.1f}"])
        tool = python_tool(box)
        rows.append(["the `python` tool, a sum", f"{median_ms(lambda: tool('print(123+456+789)'), args.repeats):.1f}",
                     "-"])
    write_section("sandbox", ["what", "in the sandbox (ms)", "on the host (ms)"], rows,
                  [(f"Median of {args.repeats} tries each, one after another in one process. A run in the sandbox "
                   "pays a fork in the jail, dropping privileges and limits, and killing what the run left; the "
                   "host's column is `subprocess.run` of the same command.")])


if __name__ == "__main__":
    main()
