"""The nightly regression's report and its MLflow side (flows/regression.py orders the phases).

`plot_trajectory` draws tonight's loss / grad-norm trajectory over the reference (`trajectory.png`),
`render_report` writes `report.md` (the checks, the fixed run, the trend of previous nights);
`write_report` puts both and `checks.json` in the report directory. `regression_experiment` and
`previous_nights` read the trend back from MLflow experiment `posttrain-regression`;
`log_report_run` records tonight as one run there (tags, `regression/*` metrics, the report files
as artifacts).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rl_core.evaluation.regression_checks import RECIPE, RUN_OVERRIDES, TRAJECTORY_KEYS, Check, fmt

EXPERIMENT = "posttrain-regression"
KIND_TAG = "posttrain.kind"
REPORT_FILES = ("report.md", "trajectory.png", "checks.json")


# ================================================================================ the report


def plot_trajectory(records: list[dict], reference: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5), dpi=100)
    for i, key in enumerate(TRAJECTORY_KEYS):
        ax = fig.add_subplot(1, len(TRAJECTORY_KEYS), i + 1)
        ref = [(r["step"], r[key]) for r in reference.get("steps", []) if key in r]
        got = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if ref:
            ax.plot(*zip(*ref), "o", color="0.6", label="reference", markersize=6)
        if got:
            ax.plot(*zip(*got), ".-", label="tonight")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def render_report(checks: list[Check], summary: dict, trend: list[dict], meta: dict) -> str:
    failed = [c for c in checks if c.status == "fail"]
    status = "FAILED" if failed else "PASSED"
    dirty = " (dirty)" if meta["git_dirty"] == "true" else ""
    header = (f"{meta['time_utc']} · code {meta['git_sha'][:12]}{dirty} · torch {meta['torch']} · training run "
              f"MLflow `{meta.get('training_run_id')}` · Prefect flow run `{meta.get('prefect_flow_run_id')}`")
    lines = [f"# Nightly regression: {status}", "", header, ""]
    if failed:
        lines += ["**Regressed:** " + ", ".join(f"`{c.name}`" for c in failed), ""]
    warned = [c for c in checks if c.status == "warn"]
    if warned:
        lines += ["**Warnings (timing, not a failure):** " + ", ".join(f"`{c.name}`" for c in warned), ""]
    lines += ["## Checks", "", "| check | status | value | threshold | detail |", "| --- | --- | --- | --- | --- |"]
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    for c in checks:
        lines.append(f"| `{c.name}` | {c.status.upper()} | {cell(c.value)} | {cell(c.threshold)} | {cell(c.detail)} |")
    fixed_run = (f"`{RECIPE}` with `{' '.join(RUN_OVERRIDES)}`: held-out accuracy "
                 f"{fmt(summary.get('initial_val_accuracy'))} -> {fmt(summary.get('final_val_accuracy'))}, rollout "
                 f"reward (last 5 steps) {fmt(summary.get('reward_mean_last5'))}, median step "
                 f"{fmt(summary.get('median_step_s'))} s, {fmt(summary.get('median_tokens_per_s'))} tokens/s.")
    trend_head = ("| date (UTC) | status | final val accuracy | reward last 5 | loss at last step | median step s "
                  "| tokens/s | regressed |")
    lines += ["", "## The fixed run", "", fixed_run, "",
              "![loss and grad norm against the reference](trajectory.png)", "",
              "## Trend (this and previous nights, from MLflow)", "",
              trend_head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in trend:
        lines.append(f"| {row['date']} | {row['status']} | {fmt(row.get('final_val_accuracy'))} | "
                     f"{fmt(row.get('reward_mean_last5'))} | {fmt(row.get('final_loss'), 6)} | "
                     f"{fmt(row.get('median_step_s'))} | {fmt(row.get('median_tokens_per_s'))} | "
                     f"{row.get('failed') or ''} |")
    return "\n".join(lines) + "\n"


def tonight_row(checks: list[Check], summary: dict, records: list[dict], meta: dict) -> dict:
    """Tonight's row of the trend table (the fields `previous_nights` reads back from MLflow)."""
    failed = [c for c in checks if c.status == "fail"]
    final_loss = next((r["train/loss"] for r in reversed(records) if "train/loss" in r), None)
    return {"date": meta["time_utc"][:16], "status": "failed" if failed else "passed",
            **{k: summary.get(k) for k in ("final_val_accuracy", "reward_mean_last5", "median_step_s",
                                           "median_tokens_per_s")},
            "final_loss": final_loss, "failed": ",".join(c.name for c in failed)}


def write_report(report_dir: Path, checks: list[Check], summary: dict, records: list[dict], reference: dict,
                 trend: list[dict], meta: dict) -> str:
    """`trajectory.png`, `report.md` and `checks.json` in `report_dir`; returns the report's markdown."""
    report_dir.mkdir(parents=True, exist_ok=True)
    plot_trajectory(records, reference, report_dir / "trajectory.png")
    report = render_report(checks, summary, trend, meta)
    (report_dir / "report.md").write_text(report)
    (report_dir / "checks.json").write_text(json.dumps([asdict(c) for c in checks], indent=1))
    return report


# ============================================================================ MLflow: the trend


def regression_experiment(tracking_uri: str) -> tuple[Any, str]:
    """(MlflowClient, id of experiment `posttrain-regression`), creating the experiment if needed; refused when it
    keeps its artifacts outside the store's artifact root (`infra.tracking.experiments.experiment_in_root`)."""
    from mlflow import MlflowClient

    from infra.tracking.experiments import experiment_in_root

    client = MlflowClient(tracking_uri=tracking_uri)
    return client, experiment_in_root(client, tracking_uri, EXPERIMENT)


def previous_nights(client, experiment_id: str, limit: int = 14) -> list[dict]:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{KIND_TAG}` = 'regression'",
                              order_by=["attributes.start_time DESC"], max_results=limit)
    out = []
    for run in runs:
        m, tags = run.data.metrics, run.data.tags
        out.append({"date": datetime.fromtimestamp(run.info.start_time / 1000, UTC).strftime("%Y-%m-%d %H:%M"),
                    "status": tags.get("posttrain.regression.status", run.info.status),
                    "final_val_accuracy": m.get("regression/final_val_accuracy"),
                    "reward_mean_last5": m.get("regression/reward_mean_last5"),
                    "final_loss": m.get("regression/final_loss"),
                    "median_step_s": m.get("regression/median_step_s"),
                    "median_tokens_per_s": m.get("regression/median_tokens_per_s"),
                    "failed": tags.get("posttrain.regression.failed", "")})
    return out


def log_report_run(client, experiment_id: str, report_dir: Path, thresholds_path: Path, checks: list[Check],
                   summary: dict, tonight: dict, meta: dict) -> str:
    """Tonight as one MLflow run (kind tag "regression", status, regressed checks, code and training /
    flow run ids; `regression/*` metrics; the report files and the thresholds under `report/`),
    terminated FAILED when a check failed. Returns its run id."""
    from infra.tracking.tracker import set_terminated

    sha, dirty = meta["git_sha"], meta["git_dirty"]
    training_run_id, flow_run_id = meta.get("training_run_id"), meta.get("prefect_flow_run_id")
    failed = [c for c in checks if c.status == "fail"]
    run = client.create_run(experiment_id, run_name=f"regression-{datetime.now(UTC):%Y%m%d-%H%M%S}", tags={
        KIND_TAG: "regression", "posttrain.regression.status": tonight["status"],
        "posttrain.regression.failed": tonight["failed"][:5000], "posttrain.git_sha": sha,
        "posttrain.git_dirty": dirty, "mlflow.source.git.commit": sha,
        **({"posttrain.training_run_id": training_run_id} if training_run_id else {}),
        **({"posttrain.prefect_flow_run_id": flow_run_id} if flow_run_id else {})})
    run_id = run.info.run_id
    try:
        metrics = {f"regression/{k}": v for k, v in {**summary, "final_loss": tonight["final_loss"]}.items()
                   if isinstance(v, (int, float)) and v is not None and math.isfinite(v)}
        metrics["regression/failed_checks"] = len(failed)
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value))
        for name in REPORT_FILES:
            client.log_artifact(run_id, str(report_dir / name), "report")
        client.log_artifact(run_id, str(thresholds_path), "report")
    finally:
        set_terminated(client, run_id, "FAILED" if failed else "FINISHED")  # its printed URI scrubbed
    return run_id
