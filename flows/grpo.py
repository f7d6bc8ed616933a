"""The GRPO-family flow: GRPO, Dr-GRPO, GSPO and legacy PG (they differ only in config).

Each step runs `rollout -> reward -> annotate -> validate -> train -> sync`, then `checkpoint` and
`evaluate` on cadence (the step loop: `flows/on_policy.py`). The flow only orders phases; the work is
in tasks, rl_core and infra.

    posttrain run recipes/arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.guard import check_run_parameters
from flows.on_policy import run_on_policy
from flows.runner import run_with_restarts
from rl_core.config.preflight import load_checked


@flow(name="grpo", log_prints=True)
def grpo(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train a GRPO-family recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    check_run_parameters(recipe, overrides)  # a deployment's parameters are untrusted input
    cfg = load_checked(recipe, overrides)  # preflight: before any placement or model construction
    return run_with_restarts(cfg, lambda c: run_on_policy(c, recipe, overrides), get_run_logger().warning)

