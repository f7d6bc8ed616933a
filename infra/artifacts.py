"""Local quickstart artifacts: the arithmetic data, the tiny model and its warm start.

`ensure_quickstart_artifacts(cfg)` builds whatever a config needs and is missing, with the values of
`params.yaml` (the DVC stages' parameters) and the same rl_core code the DVC stages call, so that
`posttrain run recipes/arithmetic.py` works on a fresh clone with no prior step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import yaml

from rl_core.config import PosttrainConfig

log = logging.getLogger("posttrain.artifacts")
REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_INIT = Path("artifacts/tiny-model/init")
TINY_WARM = Path("artifacts/tiny-model/warm")
ARITHMETIC_DIR = Path("data/arithmetic")


def load_params(path: str | Path | None = None) -> dict:
    """`params.yaml` of the working directory, else the repository's."""
    for candidate in ([Path(path)] if path else [Path("params.yaml"), REPO_ROOT / "params.yaml"]):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text()) or {}
    raise FileNotFoundError("params.yaml not found: it holds the build parameters of the quickstart artifacts")


def _is(path: str, target: Path) -> bool:
    return Path(path).resolve() == target.resolve()


def _model_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def ensure_quickstart_artifacts(cfg: PosttrainConfig, announce: Callable[[str], None] = print) -> list[str]:
    """Build the missing data / tiny model / warm start that `cfg` points at; returns what was built."""
    built: list[str] = []
    params = None
    needs_data = cfg.data.task == "arithmetic" and (
        (_is(cfg.data.train, ARITHMETIC_DIR / "train.jsonl") and not Path(cfg.data.train).is_file())
        or (_is(cfg.data.val, ARITHMETIC_DIR / "val.jsonl") and not Path(cfg.data.val).is_file())
        or (_is(cfg.model.name_or_path, TINY_WARM) and not (ARITHMETIC_DIR / "train.jsonl").is_file())
    )
    if needs_data:
        from rl_core.data.arithmetic import make_arithmetic_data

        params = params or load_params()
        announce(f"building the arithmetic data in {ARITHMETIC_DIR}/ (missing)")
        make_arithmetic_data(ARITHMETIC_DIR, **params["arithmetic_data"])
        built.append("arithmetic_data")
    wants_tiny = _is(cfg.model.name_or_path, TINY_WARM) or _is(cfg.model.name_or_path, TINY_INIT)
    if wants_tiny and not _model_complete(TINY_INIT):
        from rl_core.models import build_tiny_model

        params = params or load_params()
        announce(f"building the tiny model in {TINY_INIT}/ (missing)")
        build_tiny_model(TINY_INIT, **params["tiny_model"])
        built.append("tiny_model")
    if _is(cfg.model.name_or_path, TINY_WARM) and not _model_complete(TINY_WARM):
        from rl_core.warm_start import warm_start

        params = params or load_params()
        announce(f"warm-starting the tiny model into {TINY_WARM}/ (missing)")
        metrics = warm_start(TINY_INIT, ARITHMETIC_DIR / "train.jsonl", ARITHMETIC_DIR / "val.jsonl", TINY_WARM,
                             **params["warm_start"])
        announce(f"warm start: held-out accuracy {metrics['val_accuracy_before']:.3f} -> {metrics['val_accuracy']:.3f}")
        built.append("warm_start")
    return built
