"""annotate: group advantages, masks and the annotations table, on whole groups."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.annotate import Annotated, annotate
from rl_core.config import RLConfig


@task(name="annotate", task_run_name="annotate step {step}", cache_policy=NO_CACHE)
def annotate_task(completions: Any, rewards: list[float], prompt_ids: list[int], rl: RLConfig,
                  first_sample_id: int, padding: list[int] | None = None, row_multiple: int = 1, *,
                  step: int) -> Annotated:
    """`padding`: groups in the batch for its shape only, left out of the loss (dynamic sampling's fallback);
    `row_multiple`: the batch's rows are filled to a multiple of it (agent episodes' samples vary)."""
    return annotate(completions, rewards, prompt_ids, rl=rl, first_sample_id=first_sample_id, padding=padding or (),
                    row_multiple=row_multiple)
