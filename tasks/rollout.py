"""rollout: sample `rollout.n` completions per prompt with the current policy (retried; cached on disk).

The cache lives in the run directory (`cache/rollout-<step>-<key>.safetensors`): a retried or resumed
step reads its rollout back instead of regenerating it. Each checkpoint at step S deletes the files of
steps <= S (`prune_rollout_cache`): a resume starts after S, so only later steps' files can be read again. The files hold tensors and JSON only
(safetensors), never a pickle, so a file planted in the run directory cannot execute anything; a
file that does not read back as the expected completions is ignored and the rollout regenerated, and so is one
sampled across policy versions (`rollout.in_flight_updates`): a resumed run shares only the version it was drawn with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

log = logging.getLogger("posttrain.rollout")


def rollout_cache_key(prompt_ids: list[list[int]], n: int, sampling: Any, cache_identity: dict) -> str:
    """Same run identity, step, policy version, prompts and seed -> the same rollout; never regenerated."""
    ident = {"cache_identity": cache_identity, "prompt_ids": prompt_ids, "n": n,
             "sampling": dict(vars(sampling)) if hasattr(sampling, "__dict__") else sampling}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return "rollout-" + hashlib.sha256(blob).hexdigest()[:32]


CACHE_FILE = re.compile(r"^rollout-(?:(?P<step>\d{8})-)?[0-9a-f]{32}\.safetensors$")


def rollout_cache_file(prompt_ids: list[list[int]], n: int, sampling: Any, cache_identity: dict) -> str:
    """The cache file's name: `rollout-<step, 8 digits>-<key>.safetensors` (the step first, for pruning)."""
    key = rollout_cache_key(prompt_ids, n, sampling, cache_identity).removeprefix("rollout-")
    step = cache_identity.get("step") if isinstance(cache_identity, dict) else None
    return f"rollout-{step:08d}-{key}.safetensors" if isinstance(step, int) else f"rollout-{key}.safetensors"


def prune_rollout_cache(cache_dir: str | os.PathLike, through_step: int) -> int:
    """Delete the cached rollouts of steps <= `through_step` (and those without a step); returns how many.
    Other files are left alone."""
    removed = 0
    root = Path(cache_dir)
    if not root.is_dir():
        return 0
    for path in root.iterdir():
        match = CACHE_FILE.match(path.name)
        if match and (match["step"] is None or int(match["step"]) <= through_step):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


@task(name="rollout", task_run_name="rollout step {step}", cache_policy=NO_CACHE)
def rollout_task(engine: Any, prompt_ids: list[list[int]], n: int, sampling: Any, cache_identity: dict,
                 cache_dir: str | None = None, *, step: int) -> tuple[Any, float]:
    """`(completions, seconds inside the engines' generate)` for `prompt_ids`; completions read back from
    `cache_dir` when this exact rollout was made before (then 0 seconds)."""
    path = Path(cache_dir) / rollout_cache_file(prompt_ids, n, sampling, cache_identity) if cache_dir else None
    if (cached := _read_cached(path, len(prompt_ids) * n)) is not None:
        return cached, 0.0
    completions = engine.generate(prompt_ids, n, sampling)
    generate_s = engine.last_generate_s  # this thread's call (EnginePool keeps it per thread)
    _write_cached(path, completions)
    return completions, generate_s


@task(name="episodes", task_run_name="episodes step {step}", cache_policy=NO_CACHE)
def episodes_task(engine: Any, agent_task: Any, examples: list, tokenizer: Any, n: int, sampling: Any,
                  options: dict[str, Any], cache_identity: dict, cache_dir: str | None = None,
                  environments: Any = None, *, step: int) -> tuple[Any, float]:
    """An agent task's rollout: `n` episodes of its environment per example, turn by turn on the engines
    (`rl_core.agents.rollout_episodes`, `options` the episode's `max_turns` / `max_episode_tokens` / `scheduling`), the environments
    in `environments` (`infra.workers.environments.EnvironmentPool`); cached like `rollout_task`, the episodes'
    conversations and rewards included."""
    from rl_core.agents.rollout import rollout_episodes

    path = Path(cache_dir) / rollout_cache_file([], n, sampling, {**cache_identity, **options}) if cache_dir else None
    if (cached := _read_cached(path, len(examples) * n, episodes=True)) is not None:
        return cached, 0.0
    completions, generate_s = rollout_episodes(engine, agent_task, examples, tokenizer, n, sampling, **options,
                                             host=environments)
    _write_cached(path, completions)
    return completions, generate_s


def _read_cached(path: Path | None, rows: int, episodes: bool = False) -> Any:
    """The completions cached at `path` when it holds `rows` rows (and episode records if asked), else None."""
    from rl_core.rollout import Completions

    if path is None or not path.is_file():
        return None
    try:
        cached = Completions.load(path)
        if cached.token_version is not None:
            # weights updated in flight (rollout.in_flight_updates): its later tokens came from versions a resumed
            # run has not made (its own are trained on other batches), so only its draw's version is shared
            log.info("%s: sampled across policy versions; regenerating", path)
            return None
        if len(cached) == rows and (cached.episodes is not None) == episodes:
            return cached
        log.warning("%s: holds %d rows, not %d; regenerating", path, len(cached), rows)
    except Exception as exc:  # noqa: BLE001 - a torn, foreign or planted file: never trusted, regenerated
        log.warning("%s: not a readable rollout (%s); regenerating", path, exc)
    return None


def _write_cached(path: Path | None, completions: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    completions.save(tmp)
    os.replace(tmp, path)  # complete files only


@task(name="sync", task_run_name="sync step {step}", cache_policy=NO_CACHE)
def sync_task(cluster: Any, version: int, *, step: int) -> dict[str, float]:
    """Bring every rollout engine to trainer rank 0's weights as policy `version` (versions and checksums checked)."""
    return cluster.sync_weights(version)
