"""Preflight of where the run's models and data come from: a local directory or file, the Hugging Face cache, a quick
(seconds) reachability check of the hub (never a download), or the DVC pipeline of this checkout that builds them
(named in the error when the path is missing)."""

from __future__ import annotations

import os
from pathlib import Path

from rl_core.config.schema import PosttrainConfig
from rl_core.model.loading import looks_local

HUB_TIMEOUT_S = 5.0
# Built on demand by the flow (infra.artifacts.ensure_quickstart_artifacts) when missing.
QUICKSTART_MODELS = ("artifacts/tiny-model/init", "artifacts/tiny-model/warm", "artifacts/tiny-model/teacher",
                     "artifacts/tiny-moe/init", "artifacts/tiny-moe/warm")
QUICKSTART_DATA = ("data/arithmetic/train.jsonl", "data/arithmetic/val.jsonl",
                   "data/arithmetic-pairs/train.jsonl", "data/arithmetic-pairs/val.jsonl")


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).resolve()


def built_by(path: str) -> str | None:
    """`dvc repro <dvc.yaml>` of the pipeline in this checkout (the root one or `pipelines/*/`) with a stage whose
    output is `path`, or None."""
    import yaml

    for spec in [Path("dvc.yaml"), *sorted(Path("pipelines").glob("*/dvc.yaml"))]:
        try:
            stages = (yaml.safe_load(spec.read_text()) or {}).get("stages") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        for stage in stages.values():
            outs = [o if isinstance(o, str) else next(iter(o)) for o in (stage or {}).get("outs") or []]
            root = spec.parent / (stage.get("wdir") or ".")
            if any(_same_path(path, str(root / out)) for out in outs):
                return f"dvc repro {spec}"
    return None


def is_quickstart_data(source: str) -> bool:
    """A quickstart data split, which the flow builds when missing."""
    return any(_same_path(source, q) for q in QUICKSTART_DATA)


def local_split(source: str) -> Path | None:
    """The local file or directory a data split names (`path`, or `path:split` when `path:split` itself is not there),
    None for a hub dataset id (a name that is neither a path nor a data file)."""
    if Path(source).expanduser().exists():
        return Path(source).expanduser()
    path = Path(source.rpartition(":")[0] if ":" in source else source)
    return path.expanduser() if looks_local(source) or path.suffix in (".jsonl", ".json", ".parquet") else None


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_model_problem(key: str, name: str) -> str | None:
    """None when hub model `name` is in the local HF cache or answers on the hub within seconds."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return f"{key}={name!r} is not a local directory and huggingface_hub is not installed to fetch it"
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - an invalid repo id
        cached = None
    if isinstance(cached, str) and Path(cached).is_file():
        return None
    fix = (f"download it on a connected machine (`hf download {name}`) and point {key} at the local directory, "
           "or warm the Hugging Face cache")
    if _offline():
        return (f"{key}={name!r} is neither a local directory nor in the Hugging Face cache, and the hub is "
                f"offline (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE); {fix}")
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - not found, gated, no network: all mean "cannot load it"
        reason = type(exc).__name__
        return (f"{key}={name!r} is neither a local directory nor in the Hugging Face cache, and the hub did not "
                f"answer for it within {HUB_TIMEOUT_S:g} s ({reason}); {fix}")
    return None


def model_problem(key: str, name: str, cfg: PosttrainConfig) -> str | None:
    """Why the model at `name` (the value of config key `key`) cannot be loaded here, or None."""
    if any(_same_path(name, q) for q in QUICKSTART_MODELS):
        return None  # the flow builds the tiny model / warm start when it is missing or damaged
    if Path(name).expanduser().is_dir():
        from rl_core.model.loading import model_problem as damaged

        if problem := damaged(Path(name).expanduser(), built_here=False):
            return (f"{key}={name!r}: {problem}; copy or download the model again (the tiny model: "
                    f"`posttrain init-model`, `posttrain warm-start`), or point {key} at a whole model directory")
        return None
    if looks_local(name):
        build = f"`{command}` builds it" if (command := built_by(name)) else \
            "build the tiny model (`posttrain init-model`, `posttrain warm-start`)"
        return f"{key}={name!r}: no such local directory; {build}, or point {key} at a saved model directory or a hub id"
    return _hub_model_problem(key, name)


def reward_model_problem(key: str, name: str) -> str | None:
    """Why the reward model `name` (config key `key`) cannot be loaded here, or None."""
    from rl_core.rewards.model import resolve_reward_model

    try:
        resolve_reward_model(name, key)
    except ValueError as exc:
        return str(exc)
    return None if looks_local(name) else _hub_model_problem(key, name)


def data_problem(key: str, source: str, cfg: PosttrainConfig) -> str | None:
    """Why the data split at `source` cannot be read here, or None (hub dataset ids are not probed)."""
    from rl_core.tasks import get_task

    try:
        task = get_task(cfg.data.task)
    except ValueError:
        return None  # named by preflight's user-code check
    if is_quickstart_data(source):
        return None  # built by the flow when missing
    path = local_split(source)
    if path is None or path.exists():
        return None
    build = f"build it with {task.build_hint}, or point {key} at an existing split" if task.build_hint else \
        f"point {key} at an existing file or directory, or a hub dataset id"
    return f"{key}={source!r}: no such file; {build}"
