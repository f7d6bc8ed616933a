"""values (PPO): the critic scores the batch on the trainer ranks, and GAE turns its values into the advantages."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.algorithms.ppo import ppo_annotate
from rl_core.annotate import Annotated
from rl_core.config import RLConfig


@task(name="values", task_run_name="values step {step}", cache_policy=NO_CACHE)
def values_task(cluster: Any, annotated: Annotated, rl: RLConfig, *, step: int) -> Annotated:
    """The annotated batch with PPO's per-token advantages, returns and the critic's values (`ppo_annotate`)."""
    values, ref_logp = cluster.values(annotated.batch)
    batch, table, stats = ppo_annotate(annotated.batch, annotated.table, values, rl.objective, ref_logp)
    return Annotated(batch=batch, table=table, stats={**annotated.stats, **stats}, sampled=annotated.sampled)
