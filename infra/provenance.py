"""Provenance helpers: the DVC-locked hashes of the inputs a run reads."""

from __future__ import annotations

from pathlib import Path

import yaml

from rl_core.config import PosttrainConfig


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
