"""train: one optimizer step per mini-batch on the data-parallel policy workers."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="train", task_run_name="train step {step}", cache_policy=NO_CACHE)
def train_task(cluster: Any, batch: Any, *, step: int) -> list[dict[str, float]]:
    """Mini- and micro-batch sizes come from the workers' own config (rl.*_batch_per_replica)."""
    return cluster.train(batch)
