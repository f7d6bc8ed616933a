"""Runs against Ray clusters started outside the project, as users start them, on 127.0.0.1.

- A `ray start --head` cluster with token authentication and its dashboard (Ray's job server): the quickstart
  recipe, shrunk to two steps, submitted with `ray job submit` as docs/running.md says, from a process that is
  no Ray node. The job succeeds, its outputs are where the overrides put them (outside the job's temporary copy
  of the project), and the run joined the head with the token from its environment, on 127.0.0.1, instead of
  starting a Ray of its own. A driver with a wrong token is refused with a message that names where the token
  came from.
- Two Ray nodes: trainer ranks spread one per node (STRICT_SPREAD); after 3 steps the weights equal the
  single-node run's.

Each cluster is started by the test and stopped by its own process id (never `ray stop`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, REPO, recipe
from tests.servers import ray_head, ray_nodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def posttrain(workdir: Path, overrides: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`posttrain run` of the arithmetic recipe as a user runs it; the caller checks the exit code."""
    cmd = [sys.executable, "-m", "cli.main", "run", recipe("arithmetic"), "--", *overrides]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600, check=False)


def driver_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k not in (
        "RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(next((run_dir / "final_model").glob("*.safetensors")))


@pytest.fixture
def short_temp():
    """A short temp dir (Ray's unix sockets must fit in 107 characters)."""
    path = Path(tempfile.mkdtemp(prefix="pt-ray-", dir="/tmp"))
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# What the job's copy of the project leaves out (docs/running.md's command): what is big or belongs to other runs.
EXCLUDES = ["/.git", "/.venv", "/runs", "/artifacts", "/data", "/mlruns", "/mlartifacts", "/mlflow.db"]


def ray_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    from infra.services.supervisor import venv_bin

    return subprocess.run([venv_bin("ray"), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_a_ray_job_joins_a_token_auth_cluster_and_a_wrong_token_is_refused(workdir, short_temp, tmp_path):
    from infra.processes import free_port

    token = secrets.token_hex(32)
    out = tmp_path / "outputs"
    data = workdir / "data" / "arithmetic"
    # everything the run reads or writes by absolute path: the job runs in a temporary copy of the project
    overrides = [*FAST, f"model.name_or_path={workdir / 'artifacts' / 'tiny-model' / 'init'}",
                 f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}", "rl.max_steps=2",
                 "rl.validation.max_prompts=8", "job.name=submitted", f"job.out_dir={out / 'runs'}",
                 f"tracking.mlflow_uri=sqlite:///{out / 'mlflow.db'}"]
    client = driver_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_TMPDIR=str(short_temp))  # no Ray node
    dashboard = free_port()
    with ray_head(short_temp, num_cpus=2, token=token, dashboard_port=dashboard) as address:
        api = f"http://127.0.0.1:{dashboard}"
        submit = ["job", "submit", "--address", api, "--submission-id", "posttrain-submitted",
                  "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
                  "--", "python", "-m", "cli.main", "run", "recipes/arithmetic.py", "--", *overrides]
        deadline = time.monotonic() + 60
        while True:  # the job server refuses jobs until the head's dashboard agent has registered
            submitted = ray_cli(submit, client)
            if "No available agent" not in submitted.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        state = ray_cli(["job", "status", "--address", api, "posttrain-submitted"], client, timeout=120)
        nodes = ray_cli(["list", "nodes", "--address", api, "--format", "json"], client, timeout=120)
        # a wrong token: the join is refused, with the source of the token named (joining is all it takes)
        code = ("import sys; from rl_core.config import load_config; from infra.cluster.ray_connect import connect_ray; "
                "connect_ray(load_config(sys.argv[1], sys.argv[2:]))")
        refused = subprocess.run([sys.executable, "-c", code, recipe("arithmetic"), f"cluster.address={address}"],
                                 cwd=workdir, env=driver_env(RAY_AUTH_TOKEN=secrets.token_hex(32),
                                                             RAY_TMPDIR=str(short_temp)),
                                 capture_output=True, text=True, timeout=300, check=False)
    report = f"status {state.stdout[-2000:]}; submit:\n{submitted.stdout[-6000:]}\n{submitted.stderr[-3000:]}"
    assert submitted.returncode == 0, report
    assert "Job 'posttrain-submitted' succeeded" in re.sub(r"\x1b\[[0-9;]*m", "", state.stdout), report
    run_dir = out / "runs" / "submitted"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], report
    assert next((run_dir / "final_model").glob("*.safetensors")).stat().st_size > 0
    assert (out / "mlflow.db").is_file()
    # the run joined the head (the cluster's only node), on loopback, instead of starting a Ray of its own
    (node,) = json.loads(nodes.stdout)
    where = json.loads((run_dir / "placement.json").read_text())
    assert [t["node_id"] for t in where["trainers"]] == [node["node_id"]], (where, node)
    assert {t["ip"] for t in where["trainers"]} == {"127.0.0.1"}
    assert refused.returncode != 0
    assert f"could not join the Ray cluster at cluster.address/RAY_ADDRESS='{address}'" in refused.stderr
    assert "AuthenticationError" in refused.stderr
    assert "A token was taken from RAY_AUTH_TOKEN and refused" in refused.stderr


def test_trainer_ranks_on_two_nodes_match_the_single_node_run(in_workdir, warm_model, short_temp):
    from flows.grpo import grpo

    common = [*FAST, f"model.name_or_path={warm_model[0]}", "rl.max_steps=3", "rl.validation.before_training=false",
              "rl.validation.every_steps=0", "rl.validation.max_prompts=8", "cluster.num_workers=2",
              "rl.resume=off", "job.overwrite=true"]
    grpo(recipe("arithmetic"), [*common, "job.name=one-node"])  # the session's local Ray: one node
    with ray_nodes(short_temp, nodes=2, cpus_per_node=2) as address:
        done = posttrain(in_workdir, [*common, "job.name=two-nodes", f"cluster.address={address}",
                                      "cluster.placement_strategy=STRICT_SPREAD"],
                         driver_env(RAY_TMPDIR=str(short_temp)))
        assert done.returncode == 0, done.stderr[-4000:]
    two = in_workdir / "runs" / "two-nodes"
    where = json.loads((two / "placement.json").read_text())
    assert len({t["node_id"] for t in where["trainers"]}) == 2, where  # one rank per node
    one_w, two_w = final_weights(in_workdir / "runs" / "one-node"), final_weights(two)
    moved = 0.0
    init = load_file(next(Path(warm_model[0]).glob("*.safetensors")))
    for name in one_w:
        torch.testing.assert_close(two_w[name], one_w[name], atol=1e-6, rtol=0)
        moved = max(moved, float((one_w[name] - init[name]).abs().max()))
    assert moved > 1e-6, "the three steps changed no weight"
