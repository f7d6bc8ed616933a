"""A run submitted as a Ray job from a machine that is not a Ray node, as the README's `ray job submit` line says.

The test starts a `ray start --head` on 127.0.0.1 with its dashboard (Ray's job server), submits the
quickstart recipe, shrunk to two steps, with the project as the job's working directory, and checks
that the job succeeded, that its outputs are where the overrides put them (outside the job's temporary
copy of the project) and that the run placed its trainer on the head's node instead of starting a Ray
of its own. The head is stopped by its own process group, never `ray stop`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from infra.processes import free_port
from infra.services import venv_bin
from tests.conftest import FAST, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What the job's copy of the project leaves out (the README's command): what is big or belongs to other runs.
EXCLUDES = ["/.git", "/.venv", "/runs", "/artifacts", "/data", "/mlruns", "/mlartifacts", "/mlflow.db"]


@pytest.fixture
def short_temp():
    """A short temp dir (Ray's unix sockets must fit in 107 characters)."""
    path = Path(tempfile.mkdtemp(prefix="pt-job-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    return subprocess.run([venv_bin("ray"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_a_run_submitted_as_a_ray_job_joins_the_cluster(workdir, short_temp, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_nodes

    from tests.servers import ray_head

    out = tmp_path / "outputs"
    data = workdir / "data" / "arithmetic"
    # everything the run reads or writes by absolute path: the job runs in a temporary copy of the project
    overrides = [*FAST, f"model.name_or_path={workdir / 'artifacts' / 'tiny-model' / 'init'}",
                 f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}", "rl.max_steps=2",
                 "rl.validation.max_prompts=8", "job.name=submitted", f"job.out_dir={out / 'runs'}",
                 f"tracking.mlflow_uri=sqlite:///{out / 'mlflow.db'}"]
    dashboard = free_port()
    with ray_head(short_temp, num_cpus=2, dashboard_port=dashboard):
        address = f"http://127.0.0.1:{dashboard}"
        submit = ["job", "submit", "--address", address, "--submission-id", "posttrain-submitted",
                  "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
                  "--", "python", "-m", "cli.main", "run", "recipes/arithmetic.py", "--", *overrides]
        deadline = time.monotonic() + 60
        while True:  # the job server refuses jobs until the head's dashboard agent has registered
            submitted = ray_cli(*submit)
            if "No available agent" not in submitted.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        status = JobSubmissionClient(address).get_job_status("posttrain-submitted")
        nodes = list_nodes(address=address)
    report = f"status {status}; submit:\n{submitted.stdout[-6000:]}\n{submitted.stderr[-3000:]}"
    assert submitted.returncode == 0, report
    assert status == JobStatus.SUCCEEDED, report
    run_dir = out / "runs" / "submitted"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], report
    assert next((run_dir / "final_model").glob("*.safetensors")).stat().st_size > 0
    assert (out / "mlflow.db").is_file()
    # the run joined the head (the cluster's only node) instead of starting a Ray of its own
    assert len(nodes) == 1, nodes
    where = json.loads((run_dir / "placement.json").read_text())
    assert [t["node_id"] for t in where["trainers"]] == [nodes[0].node_id], (where, nodes)
