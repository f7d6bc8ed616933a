"""What the run's Ray actors and Ray itself may print into the progress display: no tqdm bars, no token notice."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from infra.cluster.ray_connect import QUIET_ACTOR_ENV, actor_runtime_env, quiet_token_auth
from tests.conftest import REPO, recipe

TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


def test_the_actors_runtime_env_turns_their_progress_bars_off_and_openmp_spinning(monkeypatch):
    for name in (*QUIET_ACTOR_ENV, "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert actor_runtime_env() == {"env_vars": {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                                "OMP_WAIT_POLICY": "PASSIVE"}}
    # a user's own value wins (the wait policy is the driver's, passed on to actors on any node); a variable the
    # Ray job sets is left to the job (Ray would refuse the merge)
    monkeypatch.setenv("TQDM_DISABLE", "0")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert actor_runtime_env() == {"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_WAIT_POLICY": "ACTIVE"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {
        "HF_HUB_DISABLE_PROGRESS_BARS": "0", "OMP_WAIT_POLICY": "PASSIVE"}}}))
    assert actor_runtime_env() == {"env_vars": {}}


def test_a_local_ray_gets_token_auth_without_the_notice(monkeypatch):
    """After quiet_token_auth, Ray's own default for a new local cluster keeps token mode and logs nothing."""
    from ray._private.authentication import authentication_token_setup as setup

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    quiet_token_auth()
    assert __import__("os").environ["RAY_AUTH_MODE"] == "token"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    setup.logger.addHandler(handler)
    try:
        assert setup.enable_token_auth_by_default() is True  # what ray.init does for a new local cluster
    finally:
        setup.logger.removeHandler(handler)
    assert not records
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a user's choice is kept
    quiet_token_auth()
    assert __import__("os").environ["RAY_AUTH_MODE"] == "disabled"


CHILD = """
import os, sys, ray
from infra.cluster.ray_connect import start_local_ray
from rl_core.config import load_config
start_local_ray(load_config(sys.argv[1]))
@ray.remote
def probe():
    from tqdm import tqdm
    print("actor says hello", flush=True)
    return {k: os.environ.get(k) for k in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "OMP_WAIT_POLICY")}, tqdm([1]).disable
print("RESULT", ray.get(probe.remote()), flush=True)
ray.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_local_ray_started_for_a_run_is_quiet(tmp_path):
    """`posttrain run`'s local Ray (start_local_ray): the actors' tqdm is off and their idle OpenMP threads sleep,
    their prints still reach the driver, and Ray prints no token notice."""
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "OMP_WAIT_POLICY", *QUIET_ACTOR_ENV)}
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CHILD, recipe("arithmetic")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("RESULT ({'TQDM_DISABLE': '1', 'HF_HUB_DISABLE_PROGRESS_BARS': '1', 'OMP_WAIT_POLICY': 'PASSIVE'}, "
            "True)") in out.stdout
    assert "actor says hello" in out.stdout + out.stderr  # the actors' own output is not hidden
    assert TOKEN_NOTICE not in out.stdout + out.stderr
