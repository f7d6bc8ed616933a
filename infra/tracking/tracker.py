"""MLflow tracking of a run. The numbers themselves are in `runs/<job.name>/metrics.jsonl`
(`infra.tracking.metrics_log.MetricsLog`, re-exported here), the curve is drawn by `infra.tracking.plots`.

`RunTracker` mirrors a run into MLflow (params, tags, metrics, system metrics, artifacts, provenance per attempt,
dataset inputs, sample completions, the final model as a LoggedModel); what it logs is scrubbed by
`rl_core.redact`, the one rule for keeping credentials out of output. `run_url` is the run's page in the UI.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

from infra.tracking.experiments import (  # noqa: F401 - re-exported
    TrackingError,
    check_artifact_location,
    experiment_in_root,
    sqlite_artifact_location,
)
from infra.tracking.items import run_url, server_run_url, ui_command, using_tracking_uri  # noqa: F401 - re-exported
from infra.tracking.metrics_log import MetricsLog  # noqa: F401 - re-exported
from infra.tracking.plots import CURVE_KEYS, metric_value, plot_curve  # noqa: F401 - re-exported
from infra.tracking.provenance import TAG_PREFIX, attempt_provenance, git_revision, package_versions, run_tags
from rl_core.redact import redact, redact_text

log = logging.getLogger("posttrain.tracking")


# ============================================================================ MLflow tracking
#
# One MLflow run per training run. Params are the flattened resolved config, tags carry the identity of what was run
# (objective, config hash, code revision, data hashes, versions), metrics are the metrics.jsonl records at their
# steps (and MLflow's system/* samples), artifacts are the resolved
# config, one provenance JSON per attempt, the training curves (plots/curve.png) and the `completions.json`
# table; the data splits are dataset inputs and the final model a LoggedModel. A resumed run continues the same
# MLflow run and appends `provenance/attempt_<n+1>.json`.
#
# The run is opened and ended with MLflow's fluent API (`mlflow.start_run` / `mlflow.end_run`), so MLflow sets its
# standard tags (mlflow.user, mlflow.source.*) and samples system metrics (system/*) while it is open; the final
# model goes through `mlflow.transformers.log_model` and the datasets through `mlflow.log_inputs`. The fluent API
# reads a process-wide tracking URI and keeps a per-thread stack of active runs: each fluent call here runs with
# this tracker's URI set and the process's own put back after it (`using_tracking_uri`), and the run leaves the
# stack in `finish` (called by `__exit__`, also on failure), so trackers may follow one another in one process.
# Everything else (params, tags, metrics, artifacts, tables) goes through an explicit `MlflowClient(tracking_uri=...)`
# with the run id. mlflow itself is imported lazily, so `MetricsLog` users do not pay for it.

MLFLOW_PARAM_MAX_CHARS = 6000
MLFLOW_TAG_MAX_CHARS = 8000
MLFLOW_BATCH_MAX = 100  # params/tags per log_batch call
DEFAULT_EXPERIMENT = "posttrain"

# Redaction, one rule for everything logged (`rl_core.redact`): values of secret-named keys become "***", every string
# is scrubbed of credentials in URIs and of secret-named query parameters; over-redacting only hides a value.


# ---------------------------------------------------------------------------------- provenance


def resolve_tracking_uri(cfg: Any) -> str:
    """`tracking.mlflow_uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:////<cwd>/mlflow.db`."""
    uri = cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return "sqlite:///" + str(Path.cwd().resolve() / "mlflow.db")  # absolute path: four slashes


def resolve_experiment(cfg: Any) -> str:
    """`tracking.experiment`, else `$MLFLOW_EXPERIMENT_NAME`, else "posttrain"."""
    return cfg.tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def _param_value(value: Any) -> str:
    text = str(value)  # what mlflow.log_params would store
    return text if len(text) <= MLFLOW_PARAM_MAX_CHARS else text[: MLFLOW_PARAM_MAX_CHARS - 3] + "..."


def _tag_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MLFLOW_TAG_MAX_CHARS else text[: MLFLOW_TAG_MAX_CHARS - 3] + "..."




class RunTracker:
    """One MLflow run per training run (see the module notes above).

        with RunTracker() as tracker:          # a failure inside the block finishes it as FAILED
            tracker.start(cfg, recipe=..., overrides=..., objective_identity=objective.identity, ...)
            tracker.log_metrics(record, step=record["step"])        # each metrics.jsonl record
            tracker.log_datasets(cfg, train=rows, val=val_rows)     # dataset inputs
            tracker.log_completions(step, examples, texts, rewards, count=8)  # sample completions
            tracker.log_episode_traces(step, records, rewards, count=2, policy_version=3)  # agent episodes
            tracker.log_curve(records, run_dir / "curve.png")       # at the end
            tracker.log_model(run_dir / "final_model", cfg, step)   # a LoggedModel (registered when configured)
        # a clean exit finishes it as FINISHED (or call finish() yourself); tracker.url is its page in the UI

    `tracking_uri` overrides `resolve_tracking_uri(cfg)` (tests, tools reading another store).
    """

    def __init__(self, tracking_uri: str | None = None):
        self._explicit_uri = tracking_uri
        self.tracking_uri: str | None = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.attempt: int | None = None
        self.model_info: Any = None  # the final model's `ModelInfo` (`log_model`)
        self._model_tags: dict[str, str] = {}
        self._client = None
        self._finished = False

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.run_id is None or self._finished:
            return
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            self.finish(status)
        except TrackingError:
            if exc_type is None:
                raise  # otherwise keep the original exception

    # ------------------------------------------------------------------ plumbing

    @property
    def client(self):
        if self._client is None:
            raise TrackingError("RunTracker.start() was not called; no MLflow run is open")
        return self._client

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - MLflow/requests errors may quote the URI, credentials included
            raise TrackingError(f"MLflow {what} failed: {type(exc).__name__}: {redact_text(str(exc))}") from None

    def _experiment_id(self, name: str | None, run_id: str | None) -> str:
        """The experiment of the run: `name` (created when missing) for a new run, the run's own on resume; either
        refused when its artifacts would go outside the store's artifact root (`check_artifact_location`)."""
        if run_id is None:
            return experiment_in_root(self.client, self.tracking_uri, name)
        run = self._call("get_run", self.client.get_run, run_id)
        exp = self._call("get_experiment", self.client.get_experiment, run.info.experiment_id)
        return check_artifact_location(self.client, self.tracking_uri, exp)

    def _log_batch(self, *, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        items = [Param(k, v) for k, v in (params or {}).items()]
        for i in range(0, len(items), MLFLOW_BATCH_MAX):
            self._call("log_batch(params)", self.client.log_batch, self.run_id, params=items[i:i + MLFLOW_BATCH_MAX])
        items = [RunTag(k, v) for k, v in (tags or {}).items()]
        for i in range(0, len(items), MLFLOW_BATCH_MAX):
            self._call("log_batch(tags)", self.client.log_batch, self.run_id, tags=items[i:i + MLFLOW_BATCH_MAX])

    def _active(self) -> None:
        """Refuse a fluent call where this run is not MLflow's active run (another thread, or already ended):
        MLflow would start a new run instead."""
        import mlflow

        active = mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            raise TrackingError(f"MLflow run {self.run_id} is not active in this thread; call the tracker from the "
                                "thread that started it, before finish()")

    def _next_attempt(self) -> int:
        listed = self._call("list_artifacts", self.client.list_artifacts, self.run_id, "provenance")
        numbers = [int(m.group(1)) for f in listed
                   if (m := re.fullmatch(r"(?:.*/)?attempt_(\d+)\.json", f.path))]
        return max(numbers, default=0) + 1

    # ------------------------------------------------------------------ API

    def start(self, cfg: Any, *, recipe: str | os.PathLike, overrides: Iterable[str] = (),
              objective_identity: Mapping[str, Any], run_id: str | None = None,
              prefect_flow_run_id: str | None = None, dvc_hashes: Mapping[str, str] | None = None,
              resumed_from: str | None = None, config_path: str | os.PathLike | None = None) -> str:
        """Open the run with `mlflow.start_run` (create it in `resolve_experiment(cfg)`, or reopen `run_id` on
        resume; system metrics sampled unless `tracking.system_metrics` is off) and log params, tags,
        `config_resolved.yaml` and `provenance/attempt_<n>.json`. Returns the MLflow run id. An experiment whose
        artifacts would go outside the store's artifact root is refused first (`check_artifact_location`).

        `config_path` is the run directory's `config_resolved.yaml`; None renders it from `cfg`.
        `resumed_from` names the checkpoint this attempt continues from.
        """
        import mlflow
        from mlflow import MlflowClient

        from rl_core.config.loader import config_dict, config_hash, flatten

        if self.run_id is not None:
            raise TrackingError(f"RunTracker already started run {self.run_id}; use one tracker per run")
        self.tracking_uri = self._explicit_uri or resolve_tracking_uri(cfg)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        # before anything is written: the experiment (a new run's, or the resumed run's) keeps its artifacts under
        # the store's artifact root
        experiment_id = self._experiment_id(resolve_experiment(cfg), run_id)
        cfg_hash = config_hash(cfg)
        sha, dirty = git_revision()

        # a new run in its experiment, or the run to continue
        with using_tracking_uri(self.tracking_uri):
            active = self._call("start_run", mlflow.start_run, run_id=run_id,
                                experiment_id=experiment_id if run_id is None else None,
                                run_name=cfg.job.name, log_system_metrics=cfg.tracking.system_metrics)
        self.run_id, self.experiment_id = active.info.run_id, active.info.experiment_id
        self._finished = False
        run = self._call("get_run", self.client.get_run, self.run_id)
        existing_params = dict(run.data.params) if run_id is not None else {}
        # MLflow's own tags (user, source, git remote, $MLFLOW_RUN_CONTEXT) go through the same redaction
        scrubbed = {k: redact_text(v) for k, v in run.data.tags.items() if k.startswith("mlflow.") and redact_text(v) != v}
        self._log_batch(tags=scrubbed)

        # Params are immutable in MLflow: a resumed run may only have changed cadence/logging keys
        # (resume refuses changes to the math), so those keep their first value and the new value is
        # recorded in this attempt's provenance instead.
        params = {k: _param_value(v) for k, v in redact(flatten(cfg)).items()}
        changed = {k: {"logged": existing_params[k], "now": v} for k, v in params.items()
                   if k in existing_params and existing_params[k] != v}
        self._log_batch(params={k: v for k, v in params.items() if k not in existing_params})

        identity = dict(objective_identity)
        tags = run_tags(cfg, recipe=recipe, overrides=overrides, identity=identity, config_hash=cfg_hash,
                        git=(sha, dirty), dvc_hashes=dvc_hashes, prefect_flow_run_id=prefect_flow_run_id,
                        resumed_from=resumed_from)
        self.attempt = self._next_attempt()
        tags[f"{TAG_PREFIX}attempts"] = str(self.attempt)
        self._log_batch(tags={k: _tag_value(v) for k, v in tags.items()})
        self._model_tags = {k: tags[k] for k in (f"{TAG_PREFIX}job_name", f"{TAG_PREFIX}algorithm",
                                                 f"{TAG_PREFIX}config_hash", f"{TAG_PREFIX}git_sha")}

        # config_resolved.yaml: the file as written, unless a value in it had to be redacted.
        import yaml

        text = Path(config_path).read_text() if config_path else None
        data = yaml.safe_load(text) if text is not None else config_dict(cfg)
        safe = redact(data)
        if text is None or safe != data:
            text = yaml.safe_dump(safe, sort_keys=False, default_flow_style=False)
        self._call("log_text", self.client.log_text, self.run_id, text, "config_resolved.yaml")

        provenance = attempt_provenance(self.attempt, config_hash=cfg_hash, identity=identity, git=(sha, dirty),
                                        recipe=recipe, overrides=overrides, resumed_from=resumed_from,
                                        prefect_flow_run_id=prefect_flow_run_id, dvc_hashes=dvc_hashes,
                                        params_changed=changed)
        self._call("log_text", self.client.log_text, self.run_id, json.dumps(provenance, indent=2, default=str),
                   f"provenance/attempt_{self.attempt}.json")
        return self.run_id

    def log_metrics(self, record: Mapping[str, Any], step: int) -> None:
        """Log every numeric, finite value of a metrics.jsonl record (not "step") at `step`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for key, value in record.items():
            if key == "step":
                continue
            number = metric_value(value)
            if number is not None:
                metrics.append(Metric(key=str(key), value=number, timestamp=now, step=int(step)))
        for i in range(0, len(metrics), 1000):
            self._call("log_batch(metrics)", self.client.log_batch, self.run_id, metrics=metrics[i:i + 1000])

    def log_curve(self, records: Iterable[dict[str, Any]], path_png: str | os.PathLike,
                  title: str | None = None) -> Path:
        """Plot the training curves (`infra.tracking.plots`) to `path_png` and log it as `plots/curve.png`."""
        path = Path(path_png)
        tmp_dir = path.parent / f".curve-{os.getpid()}"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        try:  # the artifact name is fixed whatever the local file is called
            staged = plot_curve(records, tmp_dir / "curve.png", title)
            self._call("log_artifact", self.client.log_artifact, self.run_id, str(staged), "plots")
            os.replace(staged, path)
        finally:
            if tmp_dir.exists():
                for leftover in tmp_dir.iterdir():
                    leftover.unlink()
                tmp_dir.rmdir()
        return path

    def log_datasets(self, cfg: Any, *, train: Any, val: Any) -> None:
        """The training and validation splits as MLflow dataset inputs of the run (contexts "training" and
        "validation"): a list of `rl_core.tasks.Example` or a DataFrame each, its source `data.train`/`data.val`."""
        import mlflow

        from infra.tracking.items import dataset

        sets = [dataset(train, cfg.data.train, cfg.data.dataset_config),
                dataset(val, cfg.data.val, cfg.data.dataset_config)]
        self._active()
        with using_tracking_uri(self.tracking_uri):
            self._call("log_inputs", mlflow.log_inputs, datasets=sets, contexts=["training", "validation"],
                       tags_list=[None, None])

    def log_completions(self, step: int, examples: Any, texts: Any, rewards: Any, *, count: int,
                        finish_reasons: Any = None, reward_values: Any = None) -> Any:
        """Append `count` of a step's completions (spread over its batch) with prompt, the row's data columns,
        reward, each reward function's value (`reward_values`, by name) and finish reason, plus this attempt's
        number, to the run's `completions.json` table (`completions_frame`); the rows appended (a pandas DataFrame)."""
        from infra.tracking.items import COMPLETIONS_TABLE, completions_frame

        frame = completions_frame(step, self.attempt, examples, texts, rewards, count, finish_reasons, reward_values)
        self._call("log_table", self.client.log_table, self.run_id, frame, COMPLETIONS_TABLE)
        return frame

    def log_episode_traces(self, step: int, records: Any, rewards: Any, *, count: int, policy_version: int) -> list:
        """`count` of a step's agent episodes as MLflow traces of this run (`infra.tracking.traces`); their ids."""
        from infra.tracking.traces import log_episode_traces

        return self._call("log traces", log_episode_traces, self.client, self.tracking_uri, self.experiment_id,
                          self.run_id, step, records, rewards, count, policy_version)

    def log_model(self, path: str | os.PathLike, cfg: Any, step: int) -> Any:
        """Log a saved model directory (weights, config, tokenizer) as a transformers LoggedModel of this run at
        `step`, named after `job.name` and registered as `tracking.registered_model_name` when that is set;
        returns MLflow's `ModelInfo` (also kept in `model_info`)."""
        from infra.tracking.items import log_transformers_model, model_card, model_task, pip_requirements

        path = Path(path)
        if not (path / "config.json").is_file():
            raise TrackingError(f"log_model({str(path)!r}): not a saved model directory (no config.json)")
        task = model_task(cfg)  # text generation; a reward model's text classification
        card = model_card(job_name=cfg.job.name, objective=cfg.rl.objective.type, base_model=cfg.model.name_or_path,
                          steps=step, run_id=self.run_id, task=task)
        with using_tracking_uri(self.tracking_uri):
            self.model_info = self._call(
                "transformers.log_model", _scrub_stdout, log_transformers_model, path, name=cfg.job.name,
                run_id=self.run_id, step=step, card=card, requirements=pip_requirements(package_versions()),
                tags=self._model_tags, registered_model_name=cfg.tracking.registered_model_name, task=task)
        return self.model_info

    @property
    def url(self) -> str:
        """The run's page in the MLflow UI (`run_url`)."""
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)

    @property
    def server_url(self) -> str | None:
        """The run's page on the MLflow server; None for a local store (`server_run_url`)."""
        return server_run_url(self.tracking_uri, self.experiment_id, self.run_id)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED (a resume can reopen it later): it leaves MLflow's active-run
        stack and its system-metrics sampling stops, also when ending it at the server fails."""
        import mlflow
        from mlflow.tracking import fluent

        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"finish(status={status!r}); expected FINISHED, FAILED or KILLED")
        if self._finished:
            return
        try:
            with using_tracking_uri(self.tracking_uri):
                active = mlflow.active_run()
                if active is not None and active.info.run_id == self.run_id:
                    self._call("end_run", _scrub_stdout, mlflow.end_run, status)
                else:  # started in another thread (MLflow's active run is per thread): end it by id
                    self._call("set_terminated", set_terminated, self.client, self.run_id, status)
        finally:
            monitor = fluent.run_id_to_system_metrics_monitor.pop(self.run_id, None)  # left when end_run failed
            if monitor is not None:
                monitor.finish()
        self._finished = True


def _scrub_stdout(fn, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` with what it prints scrubbed of credentials. MLflow prints "View run ... at: <tracking
    URI>" when a run on a server ends, and the URI may carry credentials ($MLFLOW_TRACKING_URI)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return fn(*args, **kwargs)
    finally:
        if printed.getvalue():
            sys.stdout.write(redact_text(printed.getvalue()))


def set_terminated(client: Any, run_id: str, status: str) -> None:
    """`client.set_terminated(run_id, status=status)`, what MLflow prints scrubbed (`_scrub_stdout`)."""
    _scrub_stdout(client.set_terminated, run_id, status=status)
