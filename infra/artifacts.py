"""Local quickstart artifacts: the arithmetic data, the tiny model and its warm start (and the mixture-of-experts
example's tiny model and warm start).

`ensure_quickstart_artifacts(cfg)` builds whatever a config needs and is missing, with the values of
`params.yaml` (the DVC stages' parameters) and the same rl_core code the DVC stages call, so that
`posttrain run recipes/arithmetic.py` works on a fresh clone with no prior step.

Each artifact is written beside its place and renamed into it (`rl_core.atomic`), under one lock per
working directory (`artifacts/.build.lock`), so two first runs build each artifact once and neither
reads the other's half-written files. A model directory counts as present only when its content is
whole (`rl_core.model.loading.model_problem`: JSON files parse, safetensors headers match their sizes), a
data file only when every line reads back; a damaged one is rebuilt, saying why.
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
TINY_TEACHER = Path("artifacts/tiny-model/teacher")  # OPD's CPU teacher: the warm start, trained further
TINY_MOE_INIT = Path("artifacts/tiny-moe/init")  # the mixture-of-experts example's model (recipes/moe_arithmetic.py)
TINY_MOE_WARM = Path("artifacts/tiny-moe/warm")
ARITHMETIC_DIR = Path("data/arithmetic")
ARITHMETIC_PAIRS_DIR = Path("data/arithmetic-pairs")  # DPO pairs: {train,val}.jsonl from the arithmetic splits


def load_params(path: str | Path | None = None) -> dict:
    """`params.yaml` of the working directory, else the repository's."""
    for candidate in ([Path(path)] if path else [Path("params.yaml"), REPO_ROOT / "params.yaml"]):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text()) or {}
    raise FileNotFoundError("params.yaml not found: it holds the build parameters of the quickstart artifacts")


def _is(path: str, target: Path) -> bool:
    return Path(path).resolve() == target.resolve()


BUILD_LOCK = Path("artifacts/.build.lock")


def _data_complete(path: str | Path, announce: Callable[[str], None] = lambda _: None) -> bool:
    """A data file counts as present when every line reads back as a record (a torn or damaged file: rebuilt)."""
    from rl_core.data.jsonl import iter_jsonl

    path = Path(path)
    if not path.is_file():
        return False
    try:
        if sum(1 for _ in iter_jsonl(path, "a record")):  # every line, not just the first
            return True
        problem = f"{path} holds no records"
    except ValueError as exc:
        problem = str(exc)
    announce(f"{problem}: rebuilding it")
    return False


def _model_complete(path: Path, announce: Callable[[str], None] = lambda _: None) -> bool:
    from rl_core.model.loading import model_problem

    if not path.exists():
        return False
    problem = model_problem(path)
    if problem:
        announce(f"{problem}: rebuilding {path}/")
    return problem is None


def ensure_quickstart_artifacts(cfg: PosttrainConfig, announce: Callable[[str], None] = print) -> list[str]:
    """Build the missing or damaged data / tiny model / warm start that `cfg` points at; returns what was built.

    Holds `BUILD_LOCK` while it checks and builds: a second caller waits, then finds them built."""
    import fcntl

    wanted = [cfg.model.name_or_path, getattr(cfg.model, "teacher", None) or "", cfg.data.train, cfg.data.val]
    built_here = [TINY_INIT, TINY_WARM, TINY_TEACHER, TINY_MOE_INIT, TINY_MOE_WARM,
                  *(d / f"{s}.jsonl" for d in (ARITHMETIC_DIR, ARITHMETIC_PAIRS_DIR) for s in ("train", "val"))]
    if not any(_is(path, target) for path in wanted if path for target in built_here):
        return []  # nothing of the quickstart's: no lock (and no artifacts/ directory) needed
    BUILD_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD_LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            return _ensure(cfg, announce)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _ensure(cfg: PosttrainConfig, announce: Callable[[str], None]) -> list[str]:
    built: list[str] = []
    params = None
    needs_data = (
        (_is(cfg.data.train, ARITHMETIC_DIR / "train.jsonl") and not _data_complete(cfg.data.train, announce))
        or (_is(cfg.data.val, ARITHMETIC_DIR / "val.jsonl") and not _data_complete(cfg.data.val, announce))
        or (any(_is(cfg.model.name_or_path, warm) for warm in (TINY_WARM, TINY_MOE_WARM))
            and not _data_complete(ARITHMETIC_DIR / "train.jsonl", announce))
    )
    if needs_data:
        from rl_core.data.arithmetic import make_arithmetic_data

        params = params or load_params()
        announce(f"building the arithmetic data in {ARITHMETIC_DIR}/ (missing)")
        make_arithmetic_data(ARITHMETIC_DIR, **params["arithmetic_data"])
        built.append("arithmetic_data")
    # the tiny teacher: OPD's teacher, or the model a recipe trains from (the RLHF example's reward model)
    teacher = getattr(cfg.model, "teacher", None) or (cfg.model.name_or_path if _is(cfg.model.name_or_path, TINY_TEACHER)
                                                      else None)
    wants_teacher = bool(teacher) and _is(teacher, TINY_TEACHER) and not _model_complete(TINY_TEACHER, announce)
    if wants_teacher and not needs_data and not _data_complete(ARITHMETIC_DIR / "train.jsonl", announce):
        from rl_core.data.arithmetic import make_arithmetic_data

        params = params or load_params()
        announce(f"building the arithmetic data in {ARITHMETIC_DIR}/ (missing)")
        make_arithmetic_data(ARITHMETIC_DIR, **params["arithmetic_data"])
        built.append("arithmetic_data")
    wants_tiny = _is(cfg.model.name_or_path, TINY_WARM) or _is(cfg.model.name_or_path, TINY_INIT) or wants_teacher
    if wants_tiny and not _model_complete(TINY_INIT, announce):
        from rl_core.model.loading import build_tiny_model

        params = params or load_params()
        announce(f"building the tiny model in {TINY_INIT}/ (missing)")
        build_tiny_model(TINY_INIT, **params["tiny_model"])
        built.append("tiny_model")
    if (_is(cfg.model.name_or_path, TINY_WARM) or wants_teacher) and not _model_complete(TINY_WARM, announce):
        params = params or load_params()
        built.append(_warm_start(TINY_INIT, TINY_WARM, "warm_start", params,
                                 f"warm-starting the tiny model into {TINY_WARM}/ (missing)", announce))
    if wants_teacher:
        params = params or load_params()
        built.append(_warm_start(TINY_WARM, TINY_TEACHER, "teacher_warm_start", params,
                                 f"training the warm start further into the tiny teacher {TINY_TEACHER}/ (missing)",
                                 announce))
    built += _ensure_moe(cfg, announce, params)
    if any(
            _is(source, ARITHMETIC_PAIRS_DIR / f"{split}.jsonl") and not _data_complete(source, announce)
            for source, split in ((cfg.data.train, "train"), (cfg.data.val, "val"))):
        if not _data_complete(ARITHMETIC_DIR / "val.jsonl", announce):
            from rl_core.data.arithmetic import make_arithmetic_data

            params = params or load_params()
            announce(f"building the arithmetic data in {ARITHMETIC_DIR}/ (missing)")
            make_arithmetic_data(ARITHMETIC_DIR, **params["arithmetic_data"])
            built.append("arithmetic_data")
        params = params or load_params()
        announce(f"building the arithmetic preference pairs in {ARITHMETIC_PAIRS_DIR}/ (missing)")
        make_arithmetic_pair_splits(ARITHMETIC_DIR, ARITHMETIC_PAIRS_DIR, **params["arithmetic_pairs"])
        built.append("arithmetic_pairs")
    return built


def _ensure_moe(cfg: PosttrainConfig, announce: Callable[[str], None], params: dict | None) -> list[str]:
    """The mixture-of-experts example's model and warm start, when `cfg` points at them and they are missing (what
    pipelines/moe_arithmetic/dvc.yaml builds); the arithmetic data is already there."""
    name, built = cfg.model.name_or_path, []
    if not (_is(name, TINY_MOE_INIT) or _is(name, TINY_MOE_WARM)):
        return built
    if not _model_complete(TINY_MOE_INIT, announce):
        from rl_core.model.loading import build_tiny_moe_model

        params = params or load_params()
        announce(f"building the tiny mixture-of-experts model in {TINY_MOE_INIT}/ (missing)")
        build_tiny_moe_model(TINY_MOE_INIT, **params["tiny_moe_model"])
        built.append("tiny_moe_model")
    if _is(name, TINY_MOE_WARM) and not _model_complete(TINY_MOE_WARM, announce):
        params = params or load_params()
        built.append(_warm_start(TINY_MOE_INIT, TINY_MOE_WARM, "moe_warm_start", params,
                                 f"warm-starting the tiny mixture-of-experts model into {TINY_MOE_WARM}/ (missing)",
                                 announce))
    return built


def _warm_start(start: Path, out: Path, stage: str, params: dict, saying: str,
                announce: Callable[[str], None]) -> str:
    """`out` trained from `start` on the arithmetic train split with params.yaml's `stage` values, as that DVC
    stage does; returns `stage`."""
    from rl_core.training.warm_start import DEFAULT_STEPS, progress_lines, warm_start

    announce(saying)
    steps = params[stage].get("steps", DEFAULT_STEPS)
    metrics = warm_start(start, ARITHMETIC_DIR / "train.jsonl", ARITHMETIC_DIR / "val.jsonl", out, **params[stage],
                         progress=progress_lines(steps, announce, what=stage.replace("_", " ")))
    announce(f"{stage.replace('_', ' ')}: held-out accuracy {metrics['val_accuracy_before']:.3f} -> "
             f"{metrics['val_accuracy']:.3f}")
    return stage


def make_arithmetic_pair_splits(data_dir: str | Path, out_dir: str | Path, *, seed: int,
                                max_pairs: int | None = None, max_val_pairs: int | None = None,
                                model_dir: str | Path | None = None, samples: int = 0) -> dict:
    """Preference pairs of both arithmetic splits: `out_dir/train.jsonl` from `train.jsonl`, `out_dir/val.jsonl` from
    `val.jsonl` (chosen: the answer; rejected: an off-by-one-digit answer, or with `model_dir` the model's own wrong
    answers, `samples` sampled per train prompt and its greedy one per held-out prompt); what `posttrain make-data
    arithmetic-pairs` and the DVC stages `arithmetic_pairs` and `rm_pairs` run."""
    from rl_core.data.pair_building import make_arithmetic_pairs

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    model = {"model_dir": model_dir}
    train = make_arithmetic_pairs(data_dir / "train.jsonl", out_dir / "train.jsonl", seed=seed, max_pairs=max_pairs,
                                  samples=samples, **model)
    val = make_arithmetic_pairs(data_dir / "val.jsonl", out_dir / "val.jsonl", seed=seed, max_pairs=max_val_pairs,
                                **model)
    return {"train": train["path"], "n_train": train["n_pairs"], "val": val["path"], "n_val": val["n_pairs"]}
