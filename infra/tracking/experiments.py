"""Where an MLflow experiment keeps a run's artifacts: only under the operator's artifact root.

Whoever may create experiments (an MLflow server has no authentication) may give one any location, `file://` or
`s3://` included; a run in such an experiment would write its config, completions, provenance and model there with
this process's credentials. `experiment_in_root` creates posttrain's experiments where the store puts its own and
refuses an existing one anywhere else (`check_artifact_location`); `infra.tracking.tracker.RunTracker` and the nightly
regression's report go through it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rl_core.redact import redact_text


class TrackingError(RuntimeError):
    """An MLflow call failed; the message is scrubbed of URI credentials."""


def sqlite_artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live next to the database, in `mlartifacts/` (absolute)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    if not db or db == ":memory:":
        return None
    return (Path(db).resolve().parent / "mlartifacts").as_uri()


def artifact_root_location(client: Any, tracking_uri: str, experiment_id: str) -> str:
    """Where the operator's store keeps the artifacts of experiment `experiment_id`: for a SQLite store the
    `mlartifacts/` next to the database (`sqlite_artifact_location`, where posttrain creates every experiment of
    it); for an MLflow server or any other store its default artifact root followed by the experiment id, as the
    store gives every experiment created without a location (`mlflow server --artifacts-destination` or
    `--default-artifact-root`). That root is read from the store's Default experiment (id 0, created by the store
    itself at `<root>/0`; no API call moves it)."""
    from mlflow.utils.uri import append_to_uri_path

    location = sqlite_artifact_location(tracking_uri)
    if location is not None:
        return location
    try:
        default = client.get_experiment("0").artifact_location
    except Exception as exc:  # noqa: BLE001 - no Default experiment: the root is not known
        raise TrackingError(f"the artifact root of the MLflow store at {redact_text(tracking_uri)} is not known (its "
                            f"Default experiment, id 0, does not read back: {type(exc).__name__}); posttrain writes "
                            "only under the store's own artifact root") from None
    if not default or not default.endswith("/0"):
        raise TrackingError(f"the artifact root of the MLflow store at {redact_text(tracking_uri)} is not known (its "
                            f"Default experiment's location {redact_text(str(default))!r} does not end in /0); "
                            "posttrain writes only under the store's own artifact root")
    return append_to_uri_path(default[:-1], str(experiment_id))


def check_artifact_location(client: Any, tracking_uri: str, experiment: Any) -> str:
    """`experiment.experiment_id`, once its artifact location is the one the operator's store gives it
    (`artifact_root_location`); else TrackingError naming the experiment and both locations. Whoever may create
    experiments (an MLflow server has no authentication) may give one any location, `file://` or `s3://` included:
    a run in it would write its config, completions, provenance and model there, with this process's credentials.
    """
    expected = artifact_root_location(client, tracking_uri, experiment.experiment_id)
    if experiment.artifact_location != expected:
        raise TrackingError(
            f"MLflow experiment {experiment.name!r} (id {experiment.experiment_id}) keeps its artifacts at "
            f"{redact_text(str(experiment.artifact_location))!r}, not under the artifact root of the store at "
            f"{redact_text(tracking_uri)} ({redact_text(expected)!r}): a run in it would write its config, "
            "completions, provenance and model there, so posttrain refuses it. Name another experiment "
            "(tracking.experiment), or have the operator delete this one")
    return experiment.experiment_id


def experiment_in_root(client: Any, tracking_uri: str, name: str) -> str:
    """The id of experiment `name`, created when missing (at `sqlite_artifact_location` for a SQLite store, else at
    the store's default location), refused when it exists with a location outside the store's artifact root
    (`check_artifact_location`)."""
    def read() -> Any:
        try:
            return client.get_experiment_by_name(name)
        except Exception as exc:  # noqa: BLE001 - MLflow/requests errors may quote the URI, credentials included
            raise TrackingError(f"MLflow get_experiment_by_name failed: {type(exc).__name__}: "
                                f"{redact_text(str(exc))}") from None

    exp = read()
    if exp is None:
        with contextlib.suppress(Exception):  # e.g. created concurrently by another process: read back below
            client.create_experiment(name, artifact_location=sqlite_artifact_location(tracking_uri))
        exp = read()
        if exp is None:
            raise TrackingError(f"MLflow experiment {name!r} could not be created at {redact_text(tracking_uri)}")
    return check_artifact_location(client, tracking_uri, exp)
