"""checkpoint: save the whole run state atomically (local, then S3 when configured)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.storage import CheckpointStore


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint_task(store: CheckpointStore, cluster: Any, step: int, driver_state: dict, meta: dict) -> str:
    parts = cluster.trainer_parts()
    parts["driver"] = driver_state
    return str(store.save(step, parts, meta))


@task(name="save_model", cache_policy=NO_CACHE)
def save_model_task(cluster: Any, path: Path, store: CheckpointStore | None = None) -> str:
    """The final policy as a transformers directory (safetensors), loadable by `model.name_or_path`; also under
    `store`'s remote prefix when it has one (`Cluster.save_pretrained`)."""
    return cluster.save_pretrained(path, store)
