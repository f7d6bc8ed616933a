"""tools/suite_profile.py: the kinds command lines are counted under, and a profiled command whose processes burn a
known amount of CPU, counted under their kinds with the command's exit status."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("posttrain_suite_profile", REPO / "tools" / "suite_profile.py")
suite_profile = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up
_spec.loader.exec_module(suite_profile)
kind = suite_profile.kind


@pytest.mark.parametrize(("cmdline", "expected"), [
    ("ray::PolicyWorker.train_step", "ray::PolicyWorker"),
    ("ray::IDLE", "ray::IDLE"),
    ("/v/bin/python /v/lib/python3.11/site-packages/ray/_private/workers/default_worker.py --node-ip-address=127.0.0.1",
     "Ray worker (no actor)"),
    ("/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))", "pytest worker"),
    ("/v/bin/python /v/bin/posttrain warm-start --out x", "posttrain warm-start"),
    ("/v/bin/posttrain run recipes/arithmetic.py", "posttrain run"),
    ("/v/bin/python -m prefect.engine", "python -m prefect.engine"),
    ("/v/bin/python -u -m uvicorn --factory app", "python -m uvicorn"),
    ("/v/bin/python /repo/tests/fsdp_ranks.py out.json --bf16", "fsdp_ranks.py"),
    ("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --port=1", "raylet"),
    ("", "(no command line)"),
])
def test_a_command_line_is_counted_under_its_kind(cmdline, expected):
    assert kind(cmdline) == expected


BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < float(sys.argv[1]): pass\n"


@pytest.mark.e2e  # the profiled command's processes
def test_each_process_of_the_command_is_counted_with_its_cpu_and_the_exit_status_is_the_commands(tmp_path):
    burn = tmp_path / "burn.py"
    burn.write_text(BURN)
    script = f"{sys.executable} {burn} 1.5 & {sys.executable} {burn} 1.0; wait; exit 3"
    out = tmp_path / "procs.tsv"
    run = subprocess.run([sys.executable, str(REPO / "tools" / "suite_profile.py"), "--interval", "0.2", "--tsv",
                          str(out), "--", "bash", "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    burned = sorted(float(cpu) for name, cpu, _ in rows if name == "burn.py")
    # a process's last reading may miss its last interval (more on a loaded machine, where the profiler waits its
    # turn); none can count more than the process burned plus its interpreter's start
    assert len(burned) == 2 and 0.5 <= burned[0] <= 1.5 and 1.0 <= burned[1] <= 2.0, burned
    line = next(line for line in run.stdout.splitlines() if line.endswith("  burn.py"))
    cpu, _, procs, _, _ = line.split()
    assert int(procs) == 2 and abs(float(cpu) - sum(burned)) < 0.11
    assert "exit 3" in run.stdout and "counted in" in run.stdout
