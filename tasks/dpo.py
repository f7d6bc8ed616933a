"""Offline phases (DPO, a reward model): the pair gate (whole pairs, cached reference log-probs) and held-out pair metrics."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.data.preferences import validate_pair_batch


@task(name="validate", task_run_name="validate step {step}", cache_policy=NO_CACHE)
def validate_pairs_task(batch: Any, num_workers: int, reference: bool = True, *, step: int) -> Any:
    """The pair gate (`rl_core.data.preferences.validate_pair_batch`) before dispatch; `reference`: DPO's cached
    reference log-probs are checked too."""
    return validate_pair_batch(batch, num_workers, reference)


@task(name="evaluate_pairs", task_run_name="evaluate_pairs step {step}", cache_policy=NO_CACHE)
def evaluate_pairs_task(cluster: Any, batch: Any, *, step: int) -> dict[str, float]:
    """`val/loss`, `val/reward_accuracy`, `val/margin`, ... of the held-out pairs under the current model (DPO's
    policy; a reward model's `val/accuracy`)."""
    return cluster.evaluate_pairs(batch, "val")
