"""teacher (OPD): the frozen teacher scores the student's sampled tokens; distill: the OPD advantage."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.algorithms.opd import opd_annotate
from rl_core.annotate import Annotated
from rl_core.batch.gate import validate_teacher_logp
from rl_core.config import RLConfig


@task(name="teacher", task_run_name="teacher step {step}", cache_policy=NO_CACHE)
def teacher_task(teacher: Any, batch: Any, *, step: int) -> Any:
    """The batch with `teacher_logp [B, T]` from the teacher role, checked by the gate (present, finite, <= 0)."""
    scored = batch.replace(teacher_logp=teacher.score(batch))
    validate_teacher_logp(scored)
    return scored


@task(name="distill", task_run_name="distill step {step}", cache_policy=NO_CACHE)
def distill_task(annotated: Annotated, batch: Any, rl: RLConfig, *, step: int) -> Annotated:
    """`opd_annotate` on the teacher-scored batch: per-token advantages (advantage mode); the table is unchanged."""
    batch, stats = opd_annotate(batch, rl)
    return Annotated(batch=batch, table=annotated.table, stats={**annotated.stats, **stats}, sampled=annotated.sampled)
