"""posttrain from a Python script: `train(...)` runs the same flow as `posttrain run`.

    from flows.api import train
    from my_rewards import accuracy_reward, format_reward

    result = train("recipes/chat_arithmetic.py", ["rl.max_steps=50"],
                   reward_funcs=[accuracy_reward, format_reward], reward_weights=[1.0, 0.2],
                   train_dataset=train_ds, eval_dataset=val_ds)

The config is a recipe path or a `PosttrainConfig` (None: the defaults), then the dotlist of overrides. Reward
functions are passed as function objects (TRL's `reward_funcs` / `reward_weights`); each must be importable by
its module and name, because the run records it by import path and its reward workers import it. A dataset is a
`datasets.Dataset`, a list of row dicts, or anything `data.train` takes (a path or a hub id). An in-memory dataset
is written as Parquet under `artifacts/datasets/<sha256 of its bytes>/`, so the run, its resume and its
provenance name a file whose content the name states.

The whole config is then written as a resolved YAML recipe (`artifacts/api/<sha256 of the YAML>.yaml`) and run
through `flows.entry.run_recipe`: the same checks (a `ConfigError` listing every problem), tracking and checkpoints
as a recipe file, and the flow's parameters name a file a later run or a deployment can take again.

A name is trusted only as far as the bytes under it: an existing file is reused when its content is what its name
says, and otherwise (changed since, or planted under a name that claims other content) written again whole,
through a temporary sibling and a rename. A symlink at `artifacts/datasets`, `artifacts/api` or anywhere below
them is refused naming it: these files are written by this module alone, never through a link to elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DATASETS_DIR = Path("artifacts/datasets")
CONFIGS_DIR = Path("artifacts/api")


def train(config: Any = None, overrides: Sequence[str] = (), *, reward_funcs: Sequence[Callable] | None = None,
          reward_weights: Sequence[float] | None = None, train_dataset: Any = None, eval_dataset: Any = None) -> dict:
    """Run a recipe's flow from Python; returns what `posttrain run` reports (`run_dir`, `metrics`, MLflow run)."""
    from flows.entry import run_recipe

    return run_recipe(str(resolved_recipe(config, overrides, reward_funcs=reward_funcs, reward_weights=reward_weights,
                                          train_dataset=train_dataset, eval_dataset=eval_dataset)), [])


def resolved_recipe(config: Any = None, overrides: Sequence[str] = (), *, reward_funcs=None, reward_weights=None,
                    train_dataset=None, eval_dataset=None) -> Path:
    """The resolved YAML recipe `train` runs: the config with its overrides, rewards and dataset paths applied and
    checked (`ConfigError`, every problem at once)."""
    from rl_core.atomic import write_text_atomic
    from rl_core.config import ConfigError, PosttrainConfig, load_config
    from rl_core.config.loader import config_dict, config_from_dict, to_yaml

    if config is None:
        cfg = PosttrainConfig()
    elif isinstance(config, PosttrainConfig):
        cfg = config
    elif isinstance(config, (str, os.PathLike)):
        cfg = load_config(config)
    else:
        raise ConfigError([f"config: a recipe path or a PosttrainConfig, not {type(config).__name__}"])
    data = config_dict(cfg)
    problems = []
    if reward_funcs is not None:
        try:
            data["data"]["rewards"] = reward_entries(reward_funcs, reward_weights)
        except ValueError as exc:
            problems.append(str(exc))
    elif reward_weights is not None:
        problems.append("reward_weights: given without reward_funcs; pass the functions they weigh")
    for key, dataset in (("train", train_dataset), ("val", eval_dataset)):
        if dataset is not None:
            try:
                data["data"][key] = dataset_source(dataset, key)
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    # the dotlist last, as on the command line: an override wins over what the arguments set
    cfg = config_from_dict(data, list(overrides), "posttrain.train()")
    text = to_yaml(cfg).encode()
    out = CONFIGS_DIR / f"{hashlib.sha256(text).hexdigest()}.yaml"
    try:
        _refuse_links(CONFIGS_DIR, out)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    if not (out.is_file() and out.read_bytes() == text):  # missing, changed or planted: written again, whole
        write_text_atomic(out, text.decode())
    return out


def reward_entries(functions: Sequence[Callable], weights: Sequence[float] | None = None) -> list[dict]:
    """`data.rewards` entries of function objects and their weights (TRL's `reward_funcs` / `reward_weights`; no
    weights: 1.0 each), each recorded by its import path. ValueError naming every function without one."""
    from pydantic import ValidationError

    from rl_core.config.schema import RewardEntry

    functions = list(functions)
    if weights is not None and len(weights) != len(functions):
        raise ValueError(f"reward_weights: {len(weights)} weights for {len(functions)} reward_funcs; give one weight "
                         f"per function")
    weights = [1.0] * len(functions) if weights is None else list(weights)
    entries, problems = [], []
    for i, (fn, weight) in enumerate(zip(functions, weights)):
        try:
            entries.append(RewardEntry.model_validate({"path": fn, "weight": weight}).model_dump(mode="json"))
        except ValidationError as exc:
            problems.extend(f"reward_funcs[{i}]: {e['msg']}" for e in exc.errors())
    if problems:
        raise ValueError("\n".join(problems))
    return entries


def dataset_source(dataset: Any, split: str) -> str:
    """What `data.<split>` names for `dataset`: a path or hub id as given; a `datasets.Dataset` or a list of row
    dicts written as Parquet, content-addressed. TypeError for another kind of object, ValueError for no rows."""
    if isinstance(dataset, (str, os.PathLike)):
        return os.fspath(dataset)
    from datasets import Dataset, DatasetDict

    if isinstance(dataset, DatasetDict):
        raise TypeError(f"{_argument(split)}: a DatasetDict ({', '.join(dataset)}); pass one split, e.g. "
                         f"dataset[{next(iter(dataset), 'train')!r}]")
    if isinstance(dataset, list):
        if not dataset or not all(isinstance(row, dict) for row in dataset):
            raise ValueError(f"{_argument(split)}: a list must hold the rows as dicts, at least one")
        dataset = Dataset.from_list(dataset)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"{_argument(split)}: a datasets.Dataset, a list of row dicts, a path or a hub id, not "
                         f"{type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError(f"{_argument(split)}: the dataset has no rows")
    _refuse_links(DATASETS_DIR)
    DATASETS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=DATASETS_DIR) as tmp:
        staged = Path(tmp) / f"{split}.parquet"
        dataset.to_parquet(str(staged))
        digest = _sha256(staged)
        out = DATASETS_DIR / digest / f"{split}.parquet"
        _refuse_links(out.parent, out)
        if not (out.is_file() and _sha256(out) == digest):  # missing, changed or planted: written again, whole
            out.parent.mkdir(exist_ok=True)
            os.replace(staged, out)  # a rename within one file system: atomic
    return str(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _refuse_links(*paths: Path) -> None:
    """ValueError naming the first of `paths` that is a symlink (module docstring)."""
    for path in paths:
        if path.is_symlink():
            raise ValueError(f"{path} is a symlink: the content-addressed files of posttrain's Python API are written "
                             "into directories it made, never through a link; remove the link")


def _argument(split: str) -> str:
    return "train_dataset" if split == "train" else "eval_dataset"
