"""The nightly regression flow (flows/regression.py): real Prefect (ephemeral API), real local Ray,
MLflow on SQLite, the real fixed run on the warm-started tiny model.

It passes on the current code; with one threshold tightened beyond what the run achieves it fails,
naming that check (and only that one). The warm model is the session's `warm_model` (built with
params.yaml's `warm_start`, as the DVC stage builds the nightly run's; the trajectory check
compares its hash).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import yaml

from flows.regression import EXPERIMENT, KIND_TAG, RUN_OVERRIDES, load_thresholds, regression

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def regression_dir(workdir, warm_model, tmp_path_factory) -> Path:
    """A working directory with the arithmetic data and the warm tiny model (built by params.yaml, as DVC does)."""
    root = tmp_path_factory.mktemp("regression")
    shutil.copytree(workdir / "data", root / "data")
    shutil.copytree(warm_model[0], root / "artifacts" / "tiny-model" / "warm")
    return root


def run_regression(root: Path, name: str, **params):
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        return regression(out_dir=str(root / name), mlflow_uri=f"sqlite:///{root / 'mlflow.db'}", **params,
                          return_state=True)
    finally:
        os.chdir(cwd)


def mlflow_runs(root: Path) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    return client, client.search_runs([exp.experiment_id], filter_string=f"tags.`{KIND_TAG}` = 'regression'",
                                      order_by=["attributes.start_time ASC"])


def prefect_artifacts(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def fetch():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))

    return asyncio.run(fetch())


@pytest.fixture(scope="module")
def passing(regression_dir):
    return run_regression(regression_dir, "night1")


@pytest.fixture(scope="module")
def failing(regression_dir, passing):
    """The same flow with `arithmetic.final_val_accuracy_min` raised above what the fixed run reaches."""
    achieved = json.loads((REPO / "regression" / "reference_trajectory.json").read_text())["summary"]
    limits = load_thresholds()
    limits["arithmetic"]["final_val_accuracy_min"] = round(achieved["final_val_accuracy"] + 0.1, 3)
    path = regression_dir / "tight-thresholds.yaml"
    path.write_text(yaml.safe_dump(limits))
    return run_regression(regression_dir, "night2", thresholds=str(path)), limits


def test_regression_passes_on_the_current_code(passing, regression_dir):
    state = passing
    assert state.is_completed(), state.message
    result = state.result()
    checks = {c["name"]: c for c in result["checks"]}
    failed = [c for c in checks.values() if c["status"] == "fail"]
    assert not failed, failed
    # every family ran, the fixed run is the 20-step one, its trajectory matched the reference
    for prefix in ("arithmetic.", "trajectory.", "objectives.", "gsm8k_reward.", "timing."):
        assert any(name.startswith(prefix) for name in checks), prefix
    assert checks["trajectory.train/loss"]["status"] == "pass"
    assert "rl.max_steps=20" in RUN_OVERRIDES
    metrics = regression_dir / "night1" / "regression-arithmetic" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == 20


def test_report_is_an_mlflow_artifact_and_a_prefect_table(passing, regression_dir):
    state = passing
    result = state.result()
    client, _ = mlflow_runs(regression_dir)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["posttrain.regression.status"] == "passed"
    assert run.data.metrics["regression/failed_checks"] == 0
    listed = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/trajectory.png", "report/checks.json", "report/thresholds.yaml"} <= listed
    report = (regression_dir / "night1" / "report" / "report.md").read_text()
    assert report.startswith("# Nightly regression: PASSED") and "![" in report
    png = (regression_dir / "night1" / "report" / "trajectory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # the training run of the subflow is in MLflow too, linked from the report run
    assert client.get_run(result["training_run_id"]).info.status == "FINISHED"

    artifacts = prefect_artifacts(state.state_details.flow_run_id)
    table = [a for a in artifacts if a.key == "nightly-regression"]
    assert table and table[0].type == "table"
    rows = table[0].data if isinstance(table[0].data, list) else json.loads(table[0].data)
    assert {r["name"] for r in rows} == {c["name"] for c in result["checks"]}


def test_tightened_threshold_fails_naming_the_check(failing, regression_dir):
    state, limits = failing
    assert state.is_failed()
    message = state.message or ""
    assert "arithmetic.final_val_accuracy" in message, message
    assert f"wants >= {limits['arithmetic']['final_val_accuracy_min']:g}" in message
    # only that check regressed: nothing else is named
    for other in ("trajectory.", "objectives.", "gsm8k_reward.", "arithmetic.val_accuracy_gain"):
        assert other not in message, message
    _, runs = mlflow_runs(regression_dir)
    last = runs[-1]
    assert last.info.status == "FAILED"
    assert last.data.tags["posttrain.regression.failed"] == "arithmetic.final_val_accuracy"
    # the report shows the trend: tonight (failed) and the previous night (passed), read from MLflow
    report = (regression_dir / "night2" / "report" / "report.md").read_text()
    assert report.startswith("# Nightly regression: FAILED")
    trend = report.split("## Trend")[1]
    assert "| failed |" in trend and "| passed |" in trend
