"""Runs against Ray clusters started outside the project, as users start them, on 127.0.0.1.

- An external `ray start --head` cluster with token authentication: `posttrain run` joins it with
  the token from the environment, stays on 127.0.0.1, and a wrong token fails with a message that
  names where the token comes from.
- Two Ray nodes: trainer ranks spread one per node (STRICT_SPREAD); after 3 steps the weights equal
  the single-node run's.

Each cluster is started by the test and stopped by its own process id.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
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


def test_joins_an_external_ray_start_cluster_with_token_auth(workdir, warm_model, short_temp):
    token = secrets.token_hex(32)
    common = [*FAST, f"model.name_or_path={warm_model[0]}", "rl.max_steps=2", "rl.validation.max_prompts=8",
              "rl.resume=off", "job.overwrite=true"]
    with ray_head(short_temp, token=token) as address:
        # the right token: from the environment, as docs/running.md says
        done = posttrain(workdir, [*common, "job.name=external", f"cluster.address={address}"],
                         driver_env(RAY_AUTH_TOKEN=token, RAY_TMPDIR=str(short_temp)))
        assert done.returncode == 0, done.stderr[-4000:]
        run_dir = workdir / "runs" / "external"
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2]
        where = json.loads((run_dir / "placement.json").read_text())
        assert {t["ip"] for t in where["trainers"]} == {"127.0.0.1"}  # reached on loopback, not another interface
        # a wrong token: the join is refused, with the source of the token named (joining is all it takes)
        code = ("import sys; from rl_core.config import load_config; from infra.ray_connect import connect_ray; "
                "connect_ray(load_config(sys.argv[1], sys.argv[2:]))")
        refused = subprocess.run([sys.executable, "-c", code, recipe("arithmetic"), f"cluster.address={address}"],
                                 cwd=workdir, env=driver_env(RAY_AUTH_TOKEN=secrets.token_hex(32),
                                                             RAY_TMPDIR=str(short_temp)),
                                 capture_output=True, text=True, timeout=300, check=False)
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
