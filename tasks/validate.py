"""validate: the pandera gate. A failing batch stops here, before dispatch, naming the checks."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.annotate import Annotated
from rl_core.batch.gate import validate_annotations, validate_batch_tensors


@task(name="validate", task_run_name="validate step {step}", cache_policy=NO_CACHE)
def validate_task(annotated: Annotated, max_tokens: int, group_relative: bool = True,
                  versions: tuple[int, int] | None = None, *, step: int) -> Annotated:
    """`versions`: (oldest, newest) policy version the batch may come from: the trainer's version and
    `rl.async_steps` before it."""
    validate_annotations(annotated.table, max_tokens=max_tokens, group_relative=group_relative, versions=versions)
    validate_batch_tensors(annotated.batch, annotated.table, annotated.sampled)
    return annotated
