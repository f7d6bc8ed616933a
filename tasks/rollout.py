"""rollout: sample `rollout.n` completions per prompt with the current policy (retried; cached)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE


def rollout_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Same run identity, step, policy version, prompts and seed -> the same rollout; never regenerated."""
    ident = {k: parameters[k] for k in ("cache_identity", "prompt_ids", "n", "sampling")}
    ident["sampling"] = {k: v for k, v in vars(ident["sampling"]).items()} if hasattr(ident["sampling"], "__dict__") \
        else ident["sampling"]
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return "rollout-" + hashlib.sha256(blob).hexdigest()[:32]


@task(name="rollout", cache_key_fn=rollout_cache_key, persist_result=True, cache_result_in_memory=False)
def rollout_task(engine: Any, prompt_ids: list[list[int]], n: int, sampling: Any, cache_identity: dict) -> Any:
    return engine.generate(prompt_ids, n, sampling)


@task(name="sync", cache_policy=NO_CACHE)
def sync_task(cluster: Any, version: int) -> dict[str, float]:
    """Bring every rollout engine to trainer rank 0's weights as policy `version` (versions and checksums checked)."""
    return cluster.sync_weights(version)
