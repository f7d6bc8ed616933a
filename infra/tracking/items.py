"""What a run logs to MLflow as MLflow's own objects, beyond params, tags and metrics (`infra.tracking.tracker.RunTracker`
calls these): the training and validation data as dataset inputs, sample completions with their rewards as a
table, the final model as a transformers LoggedModel, and the address of the run in the MLflow UI.

Everything here is built from local objects and files: nothing asks the Hugging Face hub (the model card is
written here, the pip requirements are the installed versions), so it works offline.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rl_core.redact import redact_text

COMPLETIONS_TABLE = "completions.json"  # one table per run; every logged step appends its rows
MODEL_TASK = "text-generation"  # the transformers pipeline a causal LM loads back as
REWARD_MODEL_TASK = "text-classification"  # ... and a reward model (AutoModelForSequenceClassification, one label)
MLFLOW_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


# ---------------------------------------------------------------------------------------- fluent API

@contextlib.contextmanager
def using_tracking_uri(uri: str):
    """MLflow's fluent calls with `uri` as the process's tracking URI; the URI the process had (set in code or in
    $MLFLOW_TRACKING_URI, which `mlflow.set_tracking_uri` also writes) is put back afterwards."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    before, env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


# ------------------------------------------------------------------------------------------ datasets

def _plain(value: Any) -> Any:
    """A cell MLflow's schema inference takes: scalars as they are, anything else (lists, dicts) as JSON text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def split_frame(rows: Any):
    """A data split as a pandas DataFrame: a DataFrame (DPO's pairs) as it is, a list of `rl_core.tasks.Example`
    as prompt, answer, chat messages and the extra reward columns; nested values become JSON text."""
    import pandas as pd

    if isinstance(rows, pd.DataFrame):
        frame = rows.copy()
    else:
        records = []
        for example in rows:
            record = {"prompt": example.prompt, "answer": example.answer}
            if example.messages is not None:
                record["messages"] = [dict(m) for m in example.messages]
            for key, value in (example.columns or {}).items():
                record.setdefault(str(key), value)
            records.append(record)
        frame = pd.DataFrame.from_records(records)
    for column in frame.columns:
        if frame[column].dtype == object:
            frame[column] = frame[column].map(_plain)
    return frame


def dataset_source(source: str, dataset_config: str | None) -> Any:
    """Where a split came from: a local file or directory as its absolute `file://` URI, else a Hugging Face hub
    dataset (`id[:split]`, split `train` when none is named, with `data.dataset_config`)."""
    path = Path(source)
    if path.exists():
        return path.resolve().as_uri()
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    name, sep, split = source.rpartition(":")
    if not sep:
        name, split = source, ""
    return HuggingFaceDatasetSource(path=redact_text(name), config_name=dataset_config, split=split or "train")


def dataset(rows: Any, source: str, dataset_config: str | None) -> Any:
    """An `mlflow.data` pandas dataset of a split, named after `source` (as the config gives it), its digest
    MLflow's hash of the rows."""
    import mlflow.data

    with warnings.catch_warnings():  # a file URI "can be interpreted in multiple ways": MLflow's local-file source
        warnings.simplefilter("ignore", UserWarning)
        return mlflow.data.from_pandas(split_frame(rows), source=dataset_source(source, dataset_config),
                                       name=redact_text(source))


# --------------------------------------------------------------------------------------- completions

def spread(total: int, count: int) -> list[int]:
    """`min(count, total)` row indices spread evenly over `range(total)` (first and last included)."""
    if total <= 0 or count <= 0:
        return []
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


FRAME_COLUMNS = ("step", "attempt", "prompt", "completion", "reward", "finish_reason")  # every table row has these


def completions_frame(step: int, attempt: int | None, examples: Sequence[Any], texts: Sequence[str],
                      rewards: Sequence[float | None], count: int, finish_reasons: Sequence[str] | None = None,
                      reward_values: dict[str, Sequence[float | None]] | None = None):
    """Rows of the completions table for one step: `count` completions spread over the batch, each with its
    prompt, the row's data columns under their own names (what the reward functions receive: `answer`, `solution`,
    ...; nested values as JSON text), completion, reward, each reward function's own value (`reward_values`: the
    functions' names, in order, to one value or None per completion) and finish reason ('length': truncated at
    rollout.max_tokens). A data column or reward whose name is already taken is `data:<name>` / `reward:<name>`."""
    import pandas as pd

    picked = spread(len(texts), count)
    data: dict[str, str] = {}  # data column -> table column, in first-seen order
    for i in picked:
        for name in examples[i].reward_columns():
            data.setdefault(name, name if name not in FRAME_COLUMNS else f"data:{name}")
    taken = set(FRAME_COLUMNS) | set(data.values())
    scores = {name: name if name not in taken else f"reward:{name}" for name in (reward_values or {})}
    rows = []
    for i in picked:
        values = examples[i].reward_columns()
        row = {"step": int(step), "attempt": attempt, "prompt": examples[i].prompt}
        row.update({column: _plain(values.get(name)) for name, column in data.items()})
        row.update({"completion": texts[i], "reward": None if rewards[i] is None else float(rewards[i])})
        row.update({column: None if reward_values[name][i] is None else float(reward_values[name][i])
                    for name, column in scores.items()})
        row["finish_reason"] = finish_reasons[i] if finish_reasons is not None else None
        rows.append(row)
    columns = ["step", "attempt", "prompt", *data.values(), "completion", "reward", *scores.values(), "finish_reason"]
    return pd.DataFrame.from_records(rows, columns=columns)


# -------------------------------------------------------------------------------------------- model

def model_task(cfg: Any) -> str:
    """The transformers pipeline the run's final model loads back as: a policy's text generation, a reward model's
    text classification."""
    return MODEL_TASK if cfg.rl.objective.trains_policy else REWARD_MODEL_TASK


def model_card(*, job_name: str, objective: str, base_model: str, steps: int, run_id: str,
               task: str = MODEL_TASK) -> Any:
    """The LoggedModel's model card (a `huggingface_hub.ModelCard`, so MLflow does not look one up on the hub)."""
    from huggingface_hub import ModelCard

    return ModelCard(f"---\nlibrary_name: transformers\npipeline_tag: {task}\n---\n# {job_name}\n\nTrained by posttrain with objective `{objective}` from "
                     f"`{redact_text(base_model)}` for {steps} steps (MLflow run `{run_id}`).\n")


def pip_requirements(versions: dict[str, str]) -> list[str]:
    """What loading the model back needs, pinned to the installed versions (MLflow's own inference of them asks
    for torchvision, which a text model does not need)."""
    return [f"{name}=={versions[name]}" for name in ("transformers", "torch") if name in versions]


def log_transformers_model(path: str | os.PathLike, *, name: str, run_id: str, step: int, card: Any,
                           requirements: list[str], tags: dict[str, str], registered_model_name: str | None,
                           task: str = MODEL_TASK) -> Any:
    """`mlflow.transformers.log_model` of a saved model directory (weights, config, tokenizer) as a LoggedModel
    linked to `run_id` at `step`, registered under `registered_model_name` when given; its `ModelInfo`.

    The directory is copied as it is (no model is loaded here); it loads back with
    `mlflow.transformers.load_model(model_uri)` as a `task` pipeline (text-generation; a reward model's
    text-classification).
    """
    import mlflow.transformers

    return mlflow.transformers.log_model(
        str(Path(path).resolve()), name=name, task=task, run_id=run_id, step=step, model_card=card,
        pip_requirements=requirements, tags=tags, registered_model_name=registered_model_name)


# ------------------------------------------------------------------------------------------ the UI

def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI: on the tracking server for an http(s) URI (its credentials left out),
    else where `mlflow ui` serves by default (http://127.0.0.1:5000)."""
    parts = urlsplit(tracking_uri or "")
    if parts.scheme in ("http", "https") and parts.hostname:
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        netloc = host + (f":{parts.port}" if parts.port else "")
        base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    else:
        base = MLFLOW_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def server_run_url(tracking_uri: str | None, experiment_id: str, run_id: str) -> str | None:
    """The run's page when the tracking URI is an MLflow server (`run_url`); None for a local store, which has no
    page until `mlflow ui` serves it."""
    if urlsplit(tracking_uri or "").scheme not in ("http", "https"):
        return None
    return run_url(tracking_uri, experiment_id, run_id)


def ui_command(tracking_uri: str) -> str | None:
    """The command that serves a local store in the MLflow UI (None for a tracking server: it is the UI)."""
    if urlsplit(tracking_uri or "").scheme in ("http", "https"):
        return None
    return f"mlflow ui --backend-store-uri {redact_text(tracking_uri)}"
