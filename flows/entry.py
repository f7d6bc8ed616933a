"""Run a recipe's flow: the GRPO family, OPD or DPO, chosen by `job.algorithm`."""

from __future__ import annotations

import importlib
import os

from rl_core.config import load_checked
from rl_core.registry import algorithm

# Quiet, local defaults for the embedded Prefect API (a user's own settings win).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Prefect gives its temporary (ephemeral) API server 20 s to start; on a loaded 2-core machine that failed
# 2 runs in 4 ("Timed out while attempting to connect to ephemeral Prefect API server"). Startup is ~17 s
# on a quiet one, so allow 3 minutes (a user's own value wins).
EPHEMERAL_STARTUP_TIMEOUT_S = "180"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S)


# the flow that runs each topology of rl_core.registry (module, flow function)
FLOWS = {"on_policy": ("flows.grpo", "grpo"), "teacher": ("flows.opd", "opd"), "offline": ("flows.dpo", "dpo")}


def flow_for(name: str):
    """The Prefect flow that runs `job.algorithm=name` (from its topology in the registry)."""
    module, attr = FLOWS[algorithm(name).topology]
    return getattr(importlib.import_module(module), attr)


def run_recipe(recipe: str, overrides: list[str]) -> dict:
    # config and preflight errors surface here, before Prefect starts; the flow takes this config, not a second load
    cfg = load_checked(str(recipe), list(overrides), hand_over=True)
    return flow_for(cfg.job.algorithm)(recipe=str(recipe), overrides=list(overrides))
