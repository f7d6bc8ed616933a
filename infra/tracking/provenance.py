"""Provenance helpers: the DVC-locked hashes of the inputs a run reads, the code revision, package versions and
the objective identity's hash (the MLflow run's tags, `infra.tracking.tracker`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rl_core.config import PosttrainConfig
from rl_core.redact import redact, redact_override, redact_text

VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "mlflow")
TAG_PREFIX = "posttrain."  # the MLflow tags posttrain sets
REPO_ROOT = Path(__file__).resolve().parents[2]


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


def run_tags(cfg: PosttrainConfig, *, recipe: str | os.PathLike, overrides: Iterable[str], identity: Mapping[str, Any],
             config_hash: str, git: tuple[str, str], dvc_hashes: Mapping[str, str] | None,
             prefect_flow_run_id: str | None, resumed_from: str | None) -> dict[str, str]:
    """The MLflow tags that name what a run is: objective, config hash, code revision, versions, data hashes, the
    Prefect flow run and the checkpoint it resumed from (redacted)."""
    sha, dirty = git
    tags = {
        f"{TAG_PREFIX}algorithm": cfg.rl.objective.type,
        f"{TAG_PREFIX}job_name": cfg.job.name,
        f"{TAG_PREFIX}recipe": redact_text(str(recipe)),
        f"{TAG_PREFIX}overrides": canonical_json([redact_override(o) for o in overrides]),
        f"{TAG_PREFIX}config_hash": config_hash,
        f"{TAG_PREFIX}objective_identity": canonical_json(redact(dict(identity))),
        f"{TAG_PREFIX}objective_hash": objective_hash(identity),
        f"{TAG_PREFIX}git_sha": sha,
        f"{TAG_PREFIX}git_dirty": dirty,
        f"{TAG_PREFIX}version.python": platform.python_version(),
        "mlflow.source.git.commit": sha,
    }
    tags.update({f"{TAG_PREFIX}version.{name}": v for name, v in package_versions().items()})
    tags.update({f"{TAG_PREFIX}dvc.{path}": str(md5) for path, md5 in (dvc_hashes or {}).items()})
    if prefect_flow_run_id:
        tags[f"{TAG_PREFIX}prefect_flow_run_id"] = str(prefect_flow_run_id)
    if resumed_from:
        tags[f"{TAG_PREFIX}resumed_from"] = redact_text(str(resumed_from))
    return tags


def attempt_provenance(attempt: int, *, config_hash: str, identity: Mapping[str, Any], git: tuple[str, str],
                       recipe: str | os.PathLike, overrides: Iterable[str], resumed_from: str | None,
                       prefect_flow_run_id: str | None, dvc_hashes: Mapping[str, str] | None,
                       params_changed: Mapping[str, Any]) -> dict[str, Any]:
    """`provenance/attempt_<n>.json`: where, when and from what one attempt of a run ran (redacted)."""
    sha, dirty = git
    return {
        "attempt": attempt,
        "attempt_time_utc": datetime.now(UTC).isoformat(),
        "config_hash": config_hash,
        "objective_hash": objective_hash(identity),
        "git_sha": sha,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "recipe": redact_text(str(recipe)),
        "overrides": [redact_override(o) for o in overrides],
        "resumed_from": redact_text(str(resumed_from)) if resumed_from else None,
        "prefect_flow_run_id": prefect_flow_run_id,
        "dvc": dict(dvc_hashes or {}),
        "versions": package_versions(),
        "params_changed_since_first_attempt": dict(params_changed),
    }
