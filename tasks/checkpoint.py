"""checkpoint: the run state, written by the trainer ranks (their shards) and the driver, published atomically (local,
then S3 when configured); the final model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.checkpoints.store import CheckpointStore


@task(name="checkpoint", task_run_name="checkpoint step {step}", cache_policy=NO_CACHE)
def start_checkpoint_task(store: CheckpointStore, cluster: Any, step: int, driver_state: dict) -> Path:
    """Start checkpoint `step` in a temporary directory of `store`: every trainer rank writes its shards there in the
    background, the driver its plain parts now; `commit_checkpoint_task` publishes it."""
    tmp = store.begin(step)
    try:
        parts = cluster.start_checkpoint(tmp)
        parts["driver"] = driver_state
        store.write_parts(tmp, parts)
    except BaseException:
        with contextlib.suppress(Exception):  # the ranks that started writing finish before the directory goes
            cluster.checkpoint_written(wait=True)
        store.abort(tmp)
        raise
    return tmp


@task(name="commit_checkpoint", task_run_name="commit_checkpoint step {step}", cache_policy=NO_CACHE)
def commit_checkpoint_task(store: CheckpointStore, tmp: Path, step: int, meta: dict, written: dict) -> str:
    """Publish checkpoint `step` (the ranks' shards are on disk, `written`): manifest last, rename, then the upload."""
    return str(store.commit(tmp, step, meta, written))


@task(name="save_model", task_run_name="save_model", cache_policy=NO_CACHE)
def save_model_task(cluster: Any, path: Path, store: CheckpointStore | None = None) -> str:
    """The final policy as a transformers directory (safetensors), loadable by `model.name_or_path`; also under
    `store`'s remote prefix when it has one (`Cluster.save_pretrained`)."""
    return cluster.save_pretrained(path, store)
