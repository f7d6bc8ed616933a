"""Nightly regression: fixed short checks compared to `regression/thresholds.yaml`.

    prefect deployment run regression/nightly-regression       (scheduled daily at 03:00 UTC)
    python -m flows.regression                                  (the same flow, in process)
    python -m flows.regression --write-reference                (regenerate the reference trajectory)

One fixed-seed 20-step run of the arithmetic recipe on the warm-started tiny model (the `grpo` flow
as a subflow) feeds checks 1, 2 and 5; checks 3 and 4 need no run:

1. `arithmetic.*`: final held-out accuracy, its gain over step 0, and the rollout reward of the
   last steps, each against a minimum.
2. `trajectory.*`: `train/loss` and `train/grad_norm` at every step against
   `regression/reference_trajectory.json`, |x - ref| <= atol + rtol |ref| (CPU float32 runs are
   bitwise repeatable on one machine and torch version; the tolerance absorbs nothing else).
3. `objectives.*`: the rl_core.primitives / annotators formulas on fixed float64 tensors against
   the plain-Python closed forms of `rl_core.evaluation.closed_forms` (the ones the test suite uses).
4. `gsm8k_reward.*`: `gsm8k_reward` on fixed completions against their known scores.
5. `timing.*`: median step time and tokens/s against a baseline: a warning, never a failure.

The flow writes `report.md` + `trajectory.png` (and the thresholds) as artifacts of its own MLflow
run in experiment `posttrain-regression`, with the previous nights' results read back from MLflow
as a trend table, and a Prefect table artifact; then it fails, naming every check that regressed.

This module only orders the phases (the fixed run, the checks, the report, its MLflow run, the
Prefect artifacts). The checks are `rl_core/evaluation/regression_checks.py` (pure); the report, the trend and
the MLflow run are `infra/tracking/regression_report.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import yaml
from prefect import flow, get_run_logger

from infra.tracking.regression_report import (
    EXPERIMENT,
    KIND_TAG,
    log_report_run,
    previous_nights,
    regression_experiment,
    tonight_row,
    write_report,
)
from infra.tracking.tracker import MetricsLog
from rl_core.evaluation.regression_checks import (
    RECIPE,
    RUN_OVERRIDES,
    TRAJECTORY_KEYS,
    Check,
    RegressionFailed,
    arithmetic_checks,
    gsm8k_checks,
    model_sha256,
    objective_checks,
    run_summary,
    timing_checks,
    trajectory_checks,
)
from rl_core.redact import redact_uri

__all__ = ["EXPERIMENT", "KIND_TAG", "RECIPE", "REFERENCE", "RUN_OVERRIDES", "THRESHOLDS", "Check",
           "RegressionFailed", "load_thresholds", "main", "regression", "run_overrides", "write_reference"]

REPO_ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = "regression/thresholds.yaml"
REFERENCE = "regression/reference_trajectory.json"


def _resolve(path: str | os.PathLike) -> Path:
    """An absolute path, or one that exists under the working directory, else the repository's file."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def load_thresholds(path: str | os.PathLike = THRESHOLDS) -> dict:
    return yaml.safe_load(_resolve(path).read_text())


def run_overrides(out_dir: str | os.PathLike, mlflow_uri: str | None, extra: list[str]) -> list[str]:
    out = [*RUN_OVERRIDES, f"job.out_dir={out_dir}", f"tracking.experiment={EXPERIMENT}", *extra]
    return out + ([f"tracking.mlflow_uri={mlflow_uri}"] if mlflow_uri else [])


# ================================================================================== the flow


@flow(name="regression", log_prints=True)
def regression(thresholds: str = THRESHOLDS, reference: str = REFERENCE, out_dir: str = "runs/regression",
               mlflow_uri: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run the fixed checks; fail naming every check that regressed.

    `thresholds`/`reference`: YAML/JSON paths (relative: the working directory's, else the repository's).
    `out_dir`: parent of the fixed run's directory and of `report/`. `mlflow_uri`: the MLflow store
    (default: $MLFLOW_TRACKING_URI, else ./mlflow.db). `overrides`: appended to the fixed run's
    overrides — for paths only (e.g. model.name_or_path=/abs/artifacts/tiny-model/warm); anything that
    changes the math makes the trajectory check fail.
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.runtime import flow_run

    from flows.grpo import grpo
    from flows.guard import check_regression_parameters, trusted_subflows
    from flows.logs import redact_run_logs
    from infra.tracking.tracker import git_revision, resolve_tracking_uri
    from rl_core.config import load_config
    from rl_core.user_code import user_error

    redact_run_logs()
    # a deployment's parameters are untrusted input; the grpo subflow's come from this code, not the caller
    check_regression_parameters(thresholds=thresholds, reference=reference, out_dir=out_dir, mlflow_uri=mlflow_uri,
                                overrides=overrides)
    logger = get_run_logger()
    limits = load_thresholds(thresholds)
    ref = json.loads(_resolve(reference).read_text())
    out = Path(out_dir).resolve()
    overrides = run_overrides(out, mlflow_uri, list(overrides or []))
    cfg = load_config(REPO_ROOT / RECIPE, overrides)
    tracking_uri = resolve_tracking_uri(cfg)

    # the fixed run (checks 1, 2, 5 read it)
    checks: list[Check] = []
    records: list[dict] = []
    summary: dict = {}
    training_run_id = None
    try:
        with trusted_subflows():
            result = grpo(recipe=str(REPO_ROOT / RECIPE), overrides=overrides)
        training_run_id = result.get("mlflow_run_id")
        records = MetricsLog(result["metrics"]).read()
    except Exception as exc:  # noqa: BLE001 - a crashed run is itself the regression; checks 3 and 4 still run
        # its error goes into the report and a Prefect artifact: described by the one redaction point
        checks.append(Check("arithmetic.run", "fail", "crashed", "completes", user_error(exc)[:500]))

    # the checks
    if records:
        summary = run_summary(records)
        checks += arithmetic_checks(summary, limits["arithmetic"])
        checks += trajectory_checks(records, ref, limits["trajectory"], model_sha256(cfg.model.name_or_path))
        checks += timing_checks(summary, limits["timing"])
    checks += objective_checks(limits["objectives"])
    checks += gsm8k_checks(limits["gsm8k_reward"])
    failed = [c for c in checks if c.status == "fail"]

    # the report, with the trend of previous nights from MLflow
    import torch

    sha, dirty = git_revision()
    meta = {"time_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "git_sha": sha, "git_dirty": dirty,
            "torch": torch.__version__, "training_run_id": training_run_id,
            "prefect_flow_run_id": str(flow_run.id) if flow_run.id else None}
    client, experiment_id = regression_experiment(tracking_uri)
    trend = previous_nights(client, experiment_id)
    tonight = tonight_row(checks, summary, records, meta)
    report_dir = out / "report"
    report = write_report(report_dir, checks, summary, records, ref, [tonight, *trend], meta)

    # its MLflow run and the Prefect artifacts
    run_id = log_report_run(client, experiment_id, report_dir, _resolve(thresholds), checks, summary, tonight, meta)
    create_table_artifact(key="nightly-regression", table=[asdict(c) for c in checks],
                          description=f"Nightly regression: {tonight['status'].upper()} "
                                      f"({len(failed)} regressed; MLflow run {run_id})")
    create_markdown_artifact(key="nightly-regression-report", markdown=report,
                             description="Nightly regression report (the plot is in the MLflow run)")
    logger.info("regression report: %s (MLflow run %s at %s)", report_dir / "report.md", run_id,
                redact_uri(tracking_uri))  # $MLFLOW_TRACKING_URI may carry basic-auth credentials
    if failed:
        raise RegressionFailed(f"{len(failed)} check(s) regressed: " + "; ".join(
            f"{c.name} ({c.value}, wants {c.threshold}){': ' + c.detail if c.detail else ''}" for c in failed))
    return {"status": "passed", "mlflow_run_id": run_id, "report": str(report_dir / "report.md"),
            "checks": [asdict(c) for c in checks], "training_run_id": training_run_id}


# ============================================================================ the reference


def write_reference(path: str | os.PathLike = REPO_ROOT / REFERENCE, out_dir: str = "runs/regression-reference",
                    extra: list[str] | None = None, add_build: bool = False) -> Path:
    """Run the fixed run (the grpo flow) and write its loss/grad-norm trajectory as the reference.

    `add_build`: keep the file's reference and add (or replace) this machine's build of the warm start under
    `other_builds`, keyed by its weights' hash: for a CPU whose warm start differs bitwise, on code whose math
    has not changed."""
    import torch

    from flows.entry import run_recipe
    from infra.tracking.tracker import git_revision, package_versions
    from rl_core.config import load_config

    out = Path(out_dir).resolve()
    overrides = run_overrides(out, "sqlite:///" + str(out / "mlflow.db"), list(extra or []))
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(REPO_ROOT / RECIPE, overrides)
    result = run_recipe(str(REPO_ROOT / RECIPE), overrides)
    records = MetricsLog(result["metrics"]).read()
    sha, dirty = git_revision()
    data = {
        "about": "Reference trajectory of the nightly regression's fixed run (flows/regression.py); regenerate "
                 "with `python -m flows.regression --write-reference` when the math changes on purpose.",
        "recipe": RECIPE, "overrides": RUN_OVERRIDES, "keys": list(TRAJECTORY_KEYS),
        "generated_utc": datetime.now(UTC).isoformat(timespec="seconds"), "git_sha": sha, "git_dirty": dirty,
        "torch": torch.__version__, "versions": package_versions(),
        "model_sha256": model_sha256(cfg.model.name_or_path),
        "summary": run_summary(records),
        "steps": [{"step": r["step"], **{k: r[k] for k in TRAJECTORY_KEYS}} for r in records if "train/loss" in r],
    }
    target = Path(path)
    if add_build:
        base = json.loads(target.read_text())
        if base.get("model_sha256") == data["model_sha256"]:
            raise ValueError(f"{target}: this machine's warm start is the file's own build; nothing to add")
        build = {k: data[k] for k in ("model_sha256", "summary", "steps", "generated_utc", "git_sha", "git_dirty",
                                      "torch")}
        build["machine"] = platform.processor() or platform.machine()
        others = [b for b in base.get("other_builds", []) if b.get("model_sha256") != data["model_sha256"]]
        data = {**base, "other_builds": [*others, build]}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.regression", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-reference", action="store_true", help="regenerate regression/reference_trajectory.json")
    parser.add_argument("--add-build", action="store_true",
                        help="with --write-reference: add this machine's warm-start build to the reference's other_builds")
    parser.add_argument("--thresholds", default=THRESHOLDS)
    parser.add_argument("--reference", default=REFERENCE)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if args.write_reference:
        print(write_reference(_resolve(args.reference), args.out_dir or "runs/regression-reference",
                              add_build=args.add_build))
        return 0
    state = regression(thresholds=args.thresholds, reference=args.reference,
                       out_dir=args.out_dir or "runs/regression", return_state=True)
    print(state.message or state.name)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    sys.exit(main())
