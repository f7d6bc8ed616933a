"""DPO phases: the pair gate (whole pairs, cached reference log-probs) and held-out pair metrics."""

from __future__ import annotations

from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rl_core.data.preferences import check_pair_layout


@task(name="validate", cache_policy=NO_CACHE)
def validate_pairs_task(batch: Any, num_workers: int) -> Any:
    """Refuse a DPO batch that is not whole (chosen, rejected) pairs, lacks finite reference log-probs, or
    does not split into whole pairs per worker."""
    check_pair_layout(batch)
    pairs = batch.batch_size // 2
    if pairs % num_workers:
        raise ValueError(f"{pairs} pairs do not split into whole pairs across cluster.num_workers={num_workers}")
    ref = batch.ref_logp
    if ref is None:
        raise ValueError("batch.ref_logp is missing: score the reference once with with_reference_logps")
    on = batch.loss_mask > 0
    bad = on & ~(torch.isfinite(ref) & (ref <= 1e-6))
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(-1)).flatten().tolist()
        raise ValueError(f"batch refused before dispatch: ref_logp is not a finite log-prob on rows {rows[:8]}")
    return batch


@task(name="evaluate_pairs", cache_policy=NO_CACHE)
def evaluate_pairs_task(cluster: Any, batch: Any) -> dict[str, float]:
    """`val/loss`, `val/reward_accuracy`, `val/margin`, ... of the held-out pairs under the current policy."""
    return cluster.evaluate_pairs(batch, "val")
