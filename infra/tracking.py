"""MLflow tracking of a run. The numbers themselves are in `runs/<job.name>/metrics.jsonl`
(`infra.metrics_log.MetricsLog`, re-exported here), the curve is drawn by `infra.plots`.

`RunTracker` mirrors a run into MLflow (params, tags, metrics, artifacts, provenance per attempt);
what it logs is scrubbed by `rl_core.redact`, the one rule for keeping credentials out of output.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from infra.metrics_log import MetricsLog  # noqa: F401 - re-exported
from infra.plots import CURVE_KEYS, metric_value, plot_curve  # noqa: F401 - re-exported
from rl_core.redact import redact, redact_override, redact_text

log = logging.getLogger("posttrain.tracking")


# ============================================================================ MLflow tracking
#
# One MLflow run per training run. Params are the flattened resolved config, tags carry the
# identity of what was run (objective, config hash, code revision, data hashes, versions), metrics
# are the metrics.jsonl records at their steps, artifacts are the resolved config, one provenance
# JSON per attempt, the training curves (plots/curve.png) and the final model. A resumed run continues the same
# MLflow run and appends `provenance/attempt_<n+1>.json`.
#
# Every call goes through an explicit `MlflowClient(tracking_uri=...)`: nothing touches MLflow's
# process-global tracking URI or active-run stack, so several trackers can live in one process.
# mlflow itself is imported lazily, so `MetricsLog` users do not pay for it.

TAG_PREFIX = "posttrain."
MLFLOW_PARAM_MAX_CHARS = 6000
MLFLOW_TAG_MAX_CHARS = 8000
MLFLOW_BATCH_MAX = 100  # params/tags per log_batch call
VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "mlflow")
REPO_ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------ redaction
#
# One rule for everything that is logged, in `rl_core.redact`: values of secret-named keys (params,
# identity, config_resolved.yaml) become "***", and every string value is scrubbed of credentials
# embedded in URIs (`scheme://user:pass@host` -> `scheme://***@host`, s3/https/http MLflow URIs, ...)
# and of secret-named query parameters (`?token=...`, `X-Amz-Signature=...`). Over-redacting is the
# safe direction: a false positive only hides a value in the MLflow UI.


# ---------------------------------------------------------------------------------- provenance


def resolve_tracking_uri(cfg: Any) -> str:
    """`tracking.mlflow_uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:////<cwd>/mlflow.db`."""
    uri = cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return "sqlite:///" + str(Path.cwd().resolve() / "mlflow.db")  # absolute path: four slashes


def sqlite_artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live next to the database, in `mlartifacts/` (absolute)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    if not db or db == ":memory:":
        return None
    return (Path(db).resolve().parent / "mlartifacts").as_uri()


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


def _param_value(value: Any) -> str:
    text = str(value)  # what mlflow.log_params would store
    return text if len(text) <= MLFLOW_PARAM_MAX_CHARS else text[: MLFLOW_PARAM_MAX_CHARS - 3] + "..."


def _tag_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MLFLOW_TAG_MAX_CHARS else text[: MLFLOW_TAG_MAX_CHARS - 3] + "..."


class TrackingError(RuntimeError):
    """An MLflow call failed; the message is scrubbed of URI credentials."""


class RunTracker:
    """One MLflow run per training run (see the module notes above).

        with RunTracker() as tracker:          # a failure inside the block finishes it as FAILED
            tracker.start(cfg, recipe=..., overrides=..., objective_identity=objective.identity, ...)
            tracker.log_metrics(record, step=record["step"])        # each metrics.jsonl record
            tracker.log_curve(records, run_dir / "curve.png")       # at the end
            tracker.log_model_dir(run_dir / "model")
        # a clean exit finishes it as FINISHED (or call finish() yourself)

    `tracking_uri` overrides `resolve_tracking_uri(cfg)` (tests, tools reading another store).
    """

    def __init__(self, tracking_uri: str | None = None):
        self._explicit_uri = tracking_uri
        self.tracking_uri: str | None = None
        self.run_id: str | None = None
        self.attempt: int | None = None
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

    def _experiment_id(self, name: str) -> str:
        exp = self._call("get_experiment_by_name", self.client.get_experiment_by_name, name)
        if exp is not None:
            return exp.experiment_id
        location = sqlite_artifact_location(self.tracking_uri)
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # noqa: BLE001 - e.g. created concurrently by another process: read it back
            exp = self._call("get_experiment_by_name", self.client.get_experiment_by_name, name)
            if exp is None:
                raise TrackingError(f"MLflow experiment {name!r} could not be created at "
                                    f"{redact_text(self.tracking_uri)}") from None
            return exp.experiment_id

    def _log_batch(self, *, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        items = [Param(k, v) for k, v in (params or {}).items()]
        for i in range(0, len(items), MLFLOW_BATCH_MAX):
            self._call("log_batch(params)", self.client.log_batch, self.run_id, params=items[i:i + MLFLOW_BATCH_MAX])
        items = [RunTag(k, v) for k, v in (tags or {}).items()]
        for i in range(0, len(items), MLFLOW_BATCH_MAX):
            self._call("log_batch(tags)", self.client.log_batch, self.run_id, tags=items[i:i + MLFLOW_BATCH_MAX])

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
        """Open the run (create it, or reopen `run_id` on resume) and log params, tags,
        `config_resolved.yaml` and `provenance/attempt_<n>.json`. Returns the MLflow run id.

        `config_path` is the run directory's `config_resolved.yaml`; None renders it from `cfg`.
        `resumed_from` names the checkpoint this attempt continues from.
        """
        from mlflow import MlflowClient
        from mlflow.entities import RunStatus

        from rl_core.config.loader import config_dict, config_hash, flatten

        if self.run_id is not None:
            raise TrackingError(f"RunTracker already started run {self.run_id}; use one tracker per run")
        self.tracking_uri = self._explicit_uri or resolve_tracking_uri(cfg)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        cfg_hash = config_hash(cfg)
        sha, dirty = git_revision()
        python = platform.python_version()

        if run_id is None:
            experiment_id = self._experiment_id(cfg.tracking.experiment)
            run = self._call("create_run", self.client.create_run, experiment_id, run_name=cfg.job.name)
            self.run_id = run.info.run_id
            existing_params: dict[str, str] = {}
        else:
            run = self._call("get_run", self.client.get_run, run_id)
            self.run_id = run.info.run_id
            existing_params = dict(run.data.params)
            self._call("update_run", self.client.update_run, self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self._finished = False

        # Params are immutable in MLflow: a resumed run may only have changed cadence/logging keys
        # (resume refuses changes to the math), so those keep their first value and the new value is
        # recorded in this attempt's provenance instead.
        params = {k: _param_value(v) for k, v in redact(flatten(cfg)).items()}
        changed = {k: {"logged": existing_params[k], "now": v} for k, v in params.items()
                   if k in existing_params and existing_params[k] != v}
        self._log_batch(params={k: v for k, v in params.items() if k not in existing_params})

        identity = dict(objective_identity)
        tags = {
            f"{TAG_PREFIX}algorithm": cfg.rl.objective.type,
            f"{TAG_PREFIX}job_name": cfg.job.name,
            f"{TAG_PREFIX}recipe": redact_text(str(recipe)),
            f"{TAG_PREFIX}overrides": canonical_json([redact_override(o) for o in overrides]),
            f"{TAG_PREFIX}config_hash": cfg_hash,
            f"{TAG_PREFIX}objective_identity": canonical_json(redact(identity)),
            f"{TAG_PREFIX}objective_hash": objective_hash(identity),
            f"{TAG_PREFIX}git_sha": sha,
            f"{TAG_PREFIX}git_dirty": dirty,
            f"{TAG_PREFIX}version.python": python,
            "mlflow.source.git.commit": sha,
        }
        tags.update({f"{TAG_PREFIX}version.{name}": v for name, v in package_versions().items()})
        tags.update({f"{TAG_PREFIX}dvc.{path}": str(md5) for path, md5 in (dvc_hashes or {}).items()})
        if prefect_flow_run_id:
            tags[f"{TAG_PREFIX}prefect_flow_run_id"] = str(prefect_flow_run_id)
        if resumed_from:
            tags[f"{TAG_PREFIX}resumed_from"] = redact_text(str(resumed_from))
        self.attempt = self._next_attempt()
        tags[f"{TAG_PREFIX}attempts"] = str(self.attempt)
        self._log_batch(tags={k: _tag_value(v) for k, v in tags.items()})

        # config_resolved.yaml: the file as written, unless a value in it had to be redacted.
        import yaml

        text = Path(config_path).read_text() if config_path else None
        data = yaml.safe_load(text) if text is not None else config_dict(cfg)
        safe = redact(data)
        if text is None or safe != data:
            text = yaml.safe_dump(safe, sort_keys=False, default_flow_style=False)
        self._call("log_text", self.client.log_text, self.run_id, text, "config_resolved.yaml")

        provenance = {
            "attempt": self.attempt,
            "attempt_time_utc": datetime.now(UTC).isoformat(),
            "config_hash": cfg_hash,
            "objective_hash": objective_hash(identity),
            "git_sha": sha,
            "git_dirty": dirty,
            "python": python,
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
            "params_changed_since_first_attempt": changed,
        }
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
        """Plot the training curves (`infra.plots`) to `path_png` and log it as `plots/curve.png`."""
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

    def log_model_dir(self, path: str | os.PathLike, artifact_path: str = "model") -> None:
        """Log a saved model directory (weights, config, tokenizer) under `artifact_path`."""
        path = Path(path)
        if not path.is_dir():
            raise TrackingError(f"log_model_dir({str(path)!r}): not a directory; pass the saved model directory")
        self._call("log_artifacts", self.client.log_artifacts, self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED (a resume can reopen it later)."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"finish(status={status!r}); expected FINISHED, FAILED or KILLED")
        if self._finished:
            return
        self._call("set_terminated", set_terminated, self.client, self.run_id, status)
        self._finished = True


def set_terminated(client: Any, run_id: str, status: str) -> None:
    """`client.set_terminated(run_id, status=status)`. MLflow prints "View run ... at: <tracking URI>" for a
    server, and the URI may carry credentials ($MLFLOW_TRACKING_URI): what it prints is scrubbed first."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            client.set_terminated(run_id, status=status)
    finally:
        if printed.getvalue():
            sys.stdout.write(redact_text(printed.getvalue()))
