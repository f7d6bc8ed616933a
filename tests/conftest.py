"""Shared fixtures: an isolated Prefect home, and a work directory with the tiny model and data built.

Flow tests run real Prefect (ephemeral API), real local Ray and MLflow on SQLite inside a temporary
working directory; nothing is written to the user's ~/.prefect or the repository.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_PREFECT_HOME = tempfile.mkdtemp(prefix="posttrain-test-prefect-")
# Set before anything imports prefect: its settings are read once.
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the ephemeral Prefect API may take longer than its default 20 s to start on a loaded 2-core machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A working directory with the arithmetic data and the tiny random-init model (no warm start)."""
    from rl_core.data.arithmetic import make_arithmetic_data
    from rl_core.models import build_tiny_model

    root = tmp_path_factory.mktemp("work")
    make_arithmetic_data(root / "data" / "arithmetic", seed=0)
    build_tiny_model(root / "artifacts" / "tiny-model" / "init", seed=0)
    return root


@pytest.fixture
def in_workdir(workdir, monkeypatch) -> Path:
    monkeypatch.chdir(workdir)
    return workdir


def recipe(name: str) -> str:
    return str(REPO / "recipes" / f"{name}.py")


# Short CPU runs of the arithmetic recipe on the random-init tiny model (fast to build).
FAST = [
    "model.name_or_path=artifacts/tiny-model/init",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rl.validation.max_prompts=16",
    "rl.validation.every_steps=2",
]
