"""Provenance helpers: the DVC-locked hashes of the inputs a run reads, the code revision, package versions and
the objective identity's hash (the MLflow run's tags, `infra.tracking`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from rl_core.config import PosttrainConfig

VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "mlflow")
REPO_ROOT = Path(__file__).resolve().parents[1]


def dvc_hashes(cfg: PosttrainConfig, lock_path: str | Path = "dvc.lock") -> dict[str, str]:
    """`{path: md5}` from dvc.lock for every locked output that the run's data or model lives in."""
    lock = Path(lock_path)
    if not lock.is_file():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    inputs = [Path(p).resolve() for p in (cfg.data.train, cfg.data.val, cfg.model.name_or_path)]
    out: dict[str, str] = {}
    for stage in stages.values():
        for entry in stage.get("outs", []):
            path = Path(entry["path"]).resolve()
            if any(i == path or path in i.parents for i in inputs):
                out[entry["path"]] = str(entry.get("md5", ""))
    return out


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def objective_hash(identity: Mapping[str, Any]) -> str:
    """sha256 of the identity's canonical JSON (sorted keys, no spaces), first 16 hex digits."""
    return hashlib.sha256(canonical_json(dict(identity)).encode()).hexdigest()[:16]


def git_revision(repo: str | os.PathLike = REPO_ROOT) -> tuple[str, str]:
    """(`git rev-parse HEAD`, "true"/"false" dirty) of the code's repository; ("unknown", "unknown")
    outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                                timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"
    return (sha or "unknown"), ("true" if status.strip() else "false")


def package_versions(names: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str]:
    """Installed versions from package metadata (nothing is imported); absent packages are skipped."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
