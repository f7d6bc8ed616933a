"""`posttrain run` as a user runs it, in a process of its own with its own Prefect home: the start-up marks
of step 1, and what the temporary Prefect API it started kept once the process has exited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import FAST, REPO, recipe
from tests.run_helpers import phase

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP = ("imports", "flow", "inputs", "tracking", "cluster", "first_rollout")  # flows/startup.py, in order
PHASES = ("rollout", "reward", "annotate", "validate", "train", "sync")

READ_TASK_RUNS = """
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

async def read():
    async with get_client() as client:
        (flow_run,) = await client.read_flow_runs()
        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        return (flow_run.name, flow_run.state.type.value,
                [[r.name, r.state.type.value if r.state else None] for r in runs])

print(json.dumps(asyncio.run(read())))
"""


def test_posttrain_run_marks_its_start_up_and_every_task_run_outlives_the_process(workdir, tmp_path):
    """Step 1 carries the start-up marks, in order. After the process has exited (its temporary API server
    stopped with it), the API's database holds the flow run and every task run, each COMPLETED: the servers
    posttrain starts write task-run states in batches (infra.services.prefect_api.PREFECT_SERVER_DEFAULTS), and the
    last batch must not be lost when the run ends."""
    home = tmp_path / "prefect-home"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(home))
    cmd = [sys.executable, "-m", "cli.main", "run", recipe("arithmetic"), "--", *FAST, "job.name=cli-run",
           "rl.max_steps=2", "rl.validation.before_training=false", "rl.save_every=0", "rl.resume=off"]
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = [json.loads(line) for line in (workdir / "runs" / "cli-run" / "metrics.jsonl").read_text().splitlines()]
    marks = [records[0][f"perf/startup/{m}_s"] for m in STARTUP]
    assert 0 < marks[0] and marks == sorted(marks), marks
    assert not any(k.startswith("perf/startup/") for k in records[1])  # step 1 only

    read = subprocess.run([sys.executable, "-c", READ_TASK_RUNS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    flow_name, flow_state, runs = json.loads(read.stdout.strip().splitlines()[-1])
    assert flow_state == "COMPLETED"
    assert flow_name == "cli-run"  # job.name, given at the flow run's creation (flows/entry.py)
    assert {name for name, _ in runs if name.startswith("train")} == {"train step 1", "train step 2"}
    names = Counter(phase(name) for name, _ in runs)
    assert {phase: names[phase] for phase in PHASES} == dict.fromkeys(PHASES, 2), names
    assert names["evaluate"] == 1 and names["save_model"] == 1, names  # step 2 (every_steps), the final model
    assert [state for _, state in runs] == ["COMPLETED"] * len(runs), runs
