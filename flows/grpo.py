"""The GRPO-family flow: GRPO, Dr-GRPO, GSPO and legacy PG (they differ only in config).

Each step runs `rollout -> reward -> annotate -> validate -> train -> sync`, then `checkpoint` and
`evaluate` on cadence (the step loop: `flows/on_policy.py`). The flow only orders phases; the work is
in tasks, rl_core and infra.

    posttrain run recipes/arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.on_policy import run_on_policy
from flows.params import NO_KNOBS, RunKnobs, open_run
from flows.restarts import run_with_restarts


@flow(name="grpo", log_prints=True)
def grpo(recipe: str, overrides: list[str] | None = None, knobs: RunKnobs = NO_KNOBS) -> dict:
    """Train a GRPO-family recipe (GRPO, Dr-GRPO, GSPO, legacy PG).

    Args:
        recipe: A recipe file under recipes/ (Python: its build_config() returns the config), or a finished run's
            config_resolved.yaml.
        overrides: Changes to the recipe, `key=value` each (e.g. rl.max_steps=20); from the API, the keys of
            flows/guard.py's allowlist only.
        knobs: The recipe knobs changed most often, typed; each one set is one more override.
    """
    overrides, cfg = open_run(recipe, overrides, knobs)  # guarded, checked (preflight), the run named job.name
    return run_with_restarts(cfg, lambda c: run_on_policy(c, recipe, overrides), get_run_logger().warning)

