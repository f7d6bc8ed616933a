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
   closed forms computed here in plain Python.
4. `gsm8k_reward.*`: `gsm8k_reward` on fixed completions against their known scores.
5. `timing.*`: median step time and tokens/s against a baseline: a warning, never a failure.

The flow writes `report.md` + `trajectory.png` (and the thresholds) as artifacts of its own MLflow
run in experiment `posttrain-regression`, with the previous nights' results read back from MLflow
as a trend table, and a Prefect table artifact; then it fails, naming every check that regressed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger

from infra.tracking import MetricsLog
from rl_core.redact import redact_uri

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/arithmetic.py"
THRESHOLDS = "regression/thresholds.yaml"
REFERENCE = "regression/reference_trajectory.json"
EXPERIMENT = "posttrain-regression"
KIND_TAG = "posttrain.kind"
# The fixed run. Anything that changes its math changes the trajectory: regenerate the reference.
RUN_OVERRIDES = [
    "job.name=regression-arithmetic",
    "job.seed=0",
    "rl.max_steps=20",
    "rl.validation.before_training=true",
    "rl.validation.every_steps=0",
    "rl.validation.max_prompts=200",
    "rl.save_every=0",
    "rl.resume=off",
    "job.overwrite=true",
]
TRAJECTORY_KEYS = ("train/loss", "train/grad_norm")


class RegressionFailed(RuntimeError):
    """One or more checks regressed; the message names each."""


@dataclass
class Check:
    name: str
    status: str  # "pass" | "fail" | "warn"
    value: str
    threshold: str
    detail: str = ""


def _resolve(path: str | os.PathLike) -> Path:
    """An absolute path, or one that exists under the working directory, else the repository's file."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def load_thresholds(path: str | os.PathLike = THRESHOLDS) -> dict:
    return yaml.safe_load(_resolve(path).read_text())


def _fmt(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


# ==================================================================== 1, 2, 5: the fixed run


def run_overrides(out_dir: str | os.PathLike, mlflow_uri: str | None, extra: list[str]) -> list[str]:
    out = [*RUN_OVERRIDES, f"job.out_dir={out_dir}", f"tracking.experiment={EXPERIMENT}", *extra]
    return out + ([f"tracking.mlflow_uri={mlflow_uri}"] if mlflow_uri else [])


def model_sha256(model_dir: str | os.PathLike) -> str | None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def run_summary(records: list[dict]) -> dict[str, float | None]:
    """The numbers checks 1 and 5 read from a run's metrics.jsonl records."""
    acc = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    steps = [r for r in records if "train/loss" in r]
    rewards = [r["rollout/reward_mean"] for r in steps if r.get("rollout/reward_mean") is not None]
    timed = steps[1:] or steps  # step 1 pays for warm-up
    return {
        "final_val_accuracy": acc[-1][1] if acc else None,
        "initial_val_accuracy": acc[0][1] if acc and acc[0][0] == 0 else None,
        "reward_mean_last5": statistics.fmean(rewards[-5:]) if rewards else None,
        "median_step_s": statistics.median(r["perf/step_s"] for r in timed) if timed else None,
        "median_tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in timed) if timed else None,
        "steps": len(steps),
    }


def arithmetic_checks(summary: dict, limits: dict) -> list[Check]:
    out = []
    gain = (None if summary["final_val_accuracy"] is None or summary["initial_val_accuracy"] is None
            else summary["final_val_accuracy"] - summary["initial_val_accuracy"])
    for name, value, key in (("final_val_accuracy", summary["final_val_accuracy"], "final_val_accuracy_min"),
                             ("val_accuracy_gain", gain, "val_accuracy_gain_min"),
                             ("reward_mean_last5", summary["reward_mean_last5"], "reward_mean_last5_min")):
        minimum = float(limits[key])
        ok = value is not None and value >= minimum
        out.append(Check(f"arithmetic.{name}", "pass" if ok else "fail", _fmt(value), f">= {minimum:g}",
                         "" if ok else f"{name}={_fmt(value)} is below the minimum {minimum:g}"))
    return out


def trajectory_checks(records: list[dict], reference: dict, limits: dict, model_hash: str | None) -> list[Check]:
    rtol, atol = float(limits["rtol"]), float(limits["atol"])
    ref_steps = {r["step"]: r for r in reference["steps"]}
    got_steps = {r["step"]: r for r in records if "train/loss" in r}
    notes = []
    if reference.get("overrides") != RUN_OVERRIDES:
        notes.append(f"the reference was generated for overrides {reference.get('overrides')}, the run uses "
                     f"{RUN_OVERRIDES}; regenerate it (python -m flows.regression --write-reference)")
    if reference.get("model_sha256") and model_hash and reference["model_sha256"] != model_hash:
        notes.append(f"the policy's weights differ from the reference's (sha256 {model_hash[:12]} vs "
                     f"{reference['model_sha256'][:12]}): a changed tiny model or warm start changes the trajectory")
    import torch

    if reference.get("torch") and reference["torch"] != torch.__version__:
        notes.append(f"the reference was made with torch {reference['torch']}, this is {torch.__version__}")
    out = []
    for key in limits.get("keys", TRAJECTORY_KEYS):
        worst, worst_step, missing = 0.0, None, []
        for step, ref in sorted(ref_steps.items()):
            got = got_steps.get(step, {}).get(key)
            if got is None:
                missing.append(step)
                continue
            excess = abs(got - ref[key]) / (atol + rtol * abs(ref[key]))  # <= 1 is within tolerance
            if excess > worst:
                worst, worst_step = excess, step
        ok = not missing and worst <= 1.0
        detail = []
        if missing:
            detail.append(f"no {key} at steps {missing}")
        if worst > 1.0:
            r = ref_steps[worst_step][key]
            g = got_steps[worst_step][key]
            detail.append(f"step {worst_step}: {key}={g:.8g} vs reference {r:.8g} "
                          f"(|diff| {abs(g - r):.3g} > {atol:g} + {rtol:g}|ref|)")
        if not ok:
            detail += notes
        out.append(Check(f"trajectory.{key}", "pass" if ok else "fail", f"{worst:.3g} x tol",
                         f"|x-ref| <= {atol:g} + {rtol:g}|ref| at {len(ref_steps)} steps", "; ".join(detail)))
    return out


def timing_checks(summary: dict, baseline: dict) -> list[Check]:
    factor = float(baseline["warn_factor"])
    out = []
    for name, value, base, slower in (
            ("step_s", summary["median_step_s"], float(baseline["step_s"]), lambda v, b: v > b * factor),
            ("tokens_per_s", summary["median_tokens_per_s"], float(baseline["tokens_per_s"]),
             lambda v, b: v < b / factor)):
        warn = value is None or slower(value, base)
        out.append(Check(f"timing.{name}", "warn" if warn else "pass", _fmt(value),
                         f"baseline {base:g} (warn beyond x{factor:g})",
                         f"median {name}={_fmt(value)} vs baseline {base:g}" if warn else ""))
    return out


# ======================================================================== 3: objective formulas

LOGP = [[-0.5, -1.2, -0.3, -2.0], [-0.1, -0.9, -1.5, -0.7], [-1.0, -0.4, -0.8, -0.2]]
OLD_LOGP = [[-0.6, -1.0, -0.35, -2.5], [-0.4, -0.9, -0.5, -2.0], [-1.1, -1.5, -0.7, -0.25]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
ADV = [1.5, -0.8, 0.3]
EPS_LOW, EPS_HIGH, DUAL_C, MAX_LEN = 0.2, 0.28, 3.0, 4
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


def _closed_clipped(level: str, dual: float) -> list[list[float]]:
    out = []
    for i, (row, old, m, a) in enumerate(zip(LOGP, OLD_LOGP, MASK, ADV)):
        z = sum((l - o) for l, o, k in zip(row, old, m) if k) / max(sum(m), 1)
        vals = []
        for l, o in zip(row, old):
            r = math.exp(min(z, 10.0)) if level == "sequence" else math.exp(max(min(l - o, 20.0), -20.0))
            loss = max(-a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH))
            if dual > 0 and a < 0:
                loss = min(loss, -dual * a)
            vals.append(loss)
        out.append(vals)
    return out


def _closed_reduce(loss: list[list[float]], loss_type: str) -> float:
    sums = [sum(v * k for v, k in zip(row, m)) for row, m in zip(loss, MASK)]
    lens = [sum(m) for m in MASK]
    if loss_type == "token-mean":
        return sum(sums) / sum(lens)
    n = sum(1 for n_ in lens if n_ > 0)
    if loss_type == "seq-mean-token-mean":
        return sum(s / n_ for s, n_ in zip(sums, lens) if n_ > 0) / n
    if loss_type == "seq-mean-token-sum":
        return sum(sums) / n
    return sum(sums) / MAX_LEN / n


def _closed_kl(estimator: str) -> list[list[float]]:
    out = []
    for row, ref in zip(LOGP, OLD_LOGP):
        vals = []
        for l, r in zip(row, ref):
            if estimator == "k1":
                vals.append(l - r)
            elif estimator == "k2":
                vals.append(0.5 * (l - r) ** 2)
            else:
                d = max(min(r - l, 20.0), -20.0)
                vals.append(max(min(math.exp(d) - d - 1.0, 10.0), -10.0))
        out.append(vals)
    return out


def _closed_advantages(unbiased: bool, eps: float = 1e-6) -> list[float]:
    out = []
    for r, g in zip(REWARDS, GROUPS):
        group = [x for x, h in zip(REWARDS, GROUPS) if h == g]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append(r - mean if unbiased else (r - mean) / (std + eps))
    return out


def objective_checks(limits: dict) -> list[Check]:
    """The primitives on fixed float64 tensors against the closed forms above."""
    import torch

    from rl_core.annotators.advantage import group_advantages
    from rl_core.primitives.kl import kl_penalty
    from rl_core.primitives.policy_gradient import (
        LOSS_TYPES,
        clipped_policy_gradient_loss,
        legacy_policy_gradient_loss,
        reduce_policy_gradient_loss,
    )

    atol = float(limits["atol"])
    def t(x):
        return torch.tensor(x, dtype=torch.float64)

    logp, old, mask, adv = t(LOGP), t(OLD_LOGP), t(MASK), t(ADV)

    def masked_diff(got: torch.Tensor, want: list[list[float]]) -> float:
        return max(abs(float(got[i, j]) - want[i][j]) for i in range(len(MASK)) for j in range(len(MASK[0]))
                   if MASK[i][j])

    results: list[tuple[str, float]] = []
    token, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                            lower_bound_ratio=0.0)
    results.append(("clipped_token", masked_diff(token, _closed_clipped("token", 0.0))))
    dual, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                           lower_bound_ratio=DUAL_C)
    results.append(("clipped_token_dual_clip", masked_diff(dual, _closed_clipped("token", DUAL_C))))
    seq, _ = clipped_policy_gradient_loss(logp, old, adv, mask, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                          importance_sampling_level="sequence")
    results.append(("gspo_sequence", masked_diff(seq, _closed_clipped("sequence", 0.0))))
    legacy = legacy_policy_gradient_loss(logp, adv, mask)
    results.append(("legacy_pg", masked_diff(legacy, [[-a * l for l in row] for row, a in zip(LOGP, ADV)])))
    closed_dual = _closed_clipped("token", DUAL_C)
    for loss_type in LOSS_TYPES:
        num, weight = reduce_policy_gradient_loss(dual, mask, loss_type, max_response_length=MAX_LEN)
        results.append((f"reduce.{loss_type}", abs(float(num / weight) - _closed_reduce(closed_dual, loss_type))))
    for estimator in ("k1", "k2", "k3"):
        results.append((f"kl.{estimator}", masked_diff(kl_penalty(logp, old, estimator), _closed_kl(estimator))))
    for label, unbiased in (("grpo", False), ("dr_grpo", True)):
        got = group_advantages(t(REWARDS), torch.tensor(GROUPS), unbiased=unbiased, eps=1e-6)
        want = _closed_advantages(unbiased)
        results.append((f"group_advantage.{label}", max(abs(float(g) - w) for g, w in zip(got, want))))
    return [Check(f"objectives.{name}", "pass" if err <= atol else "fail", f"{err:.2e}", f"<= {atol:g}",
                  "" if err <= atol else f"max |primitive - closed form| = {err:.3g}") for name, err in results]


# ============================================================================ 4: GSM8K reward

GSM8K_CASES = [  # (completion, answer, mode, expected reward)
    ("so the answer is #### 18", "18", "strict", 1.0),
    ("#### 18.00", "Natalia sold 48 clips in April ... #### 18", "strict", 1.0),
    ("#### $1,234.", "1234", "strict", 1.0),
    ("#### 17 wait, no: #### 18", "18", "strict", 1.0),
    ("#### 18 wait, no: #### 17", "18", "strict", 0.0),
    ("#### 18 and more text after the answer", "18", "strict", 1.0),
    ("the answer is 18", "18", "strict", 0.0),
    ("the answer is 18", "18", "flexible", 1.0),
    ("it is 3, not 4", "4", "flexible", 1.0),
    ("18.01", "18", "flexible", 0.0),
    ("#### -5", "-5", "strict", 1.0),
    ("#### \u22125", "-5", "strict", 1.0),
    ("", "18", "strict", 0.0),
    ("#### ", "18", "strict", 0.0),
    ("#### 18", "no number here", "strict", 0.0),
]


def gsm8k_checks(limits: dict) -> list[Check]:
    from rl_core.rewards.gsm8k import gsm8k_reward

    wrong = [(c, a, m, want, got) for c, a, m, want in GSM8K_CASES
             if (got := gsm8k_reward(c, a, m)) != want]
    accuracy = 1 - len(wrong) / len(GSM8K_CASES)
    minimum = float(limits["agreement_min"])
    ok = accuracy >= minimum
    detail = "; ".join(f"{c!r} vs {a!r} ({m}): {got} != {want}" for c, a, m, want, got in wrong[:5])
    return [Check("gsm8k_reward.fixed_completions", "pass" if ok else "fail", f"{accuracy:.3f}",
                  f">= {minimum:g} of {len(GSM8K_CASES)} cases", detail)]


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
                 f"{_fmt(summary.get('initial_val_accuracy'))} -> {_fmt(summary.get('final_val_accuracy'))}, rollout "
                 f"reward (last 5 steps) {_fmt(summary.get('reward_mean_last5'))}, median step "
                 f"{_fmt(summary.get('median_step_s'))} s, {_fmt(summary.get('median_tokens_per_s'))} tokens/s.")
    trend_head = ("| date (UTC) | status | final val accuracy | reward last 5 | loss at last step | median step s "
                  "| tokens/s | regressed |")
    lines += ["", "## The fixed run", "", fixed_run, "",
              "![loss and grad norm against the reference](trajectory.png)", "",
              "## Trend (this and previous nights, from MLflow)", "",
              trend_head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in trend:
        lines.append(f"| {row['date']} | {row['status']} | {_fmt(row.get('final_val_accuracy'))} | "
                     f"{_fmt(row.get('reward_mean_last5'))} | {_fmt(row.get('final_loss'), 6)} | "
                     f"{_fmt(row.get('median_step_s'))} | {_fmt(row.get('median_tokens_per_s'))} | "
                     f"{row.get('failed') or ''} |")
    return "\n".join(lines) + "\n"


def _client_and_experiment(tracking_uri: str) -> tuple[Any, str]:
    from mlflow import MlflowClient

    from infra.tracking import _sqlite_artifact_location

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is not None:
        return client, exp.experiment_id
    try:
        return client, client.create_experiment(EXPERIMENT, artifact_location=_sqlite_artifact_location(tracking_uri))
    except Exception:  # noqa: BLE001 - created concurrently: read it back
        return client, client.get_experiment_by_name(EXPERIMENT).experiment_id


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
    from infra.tracking import git_revision, resolve_tracking_uri, set_terminated
    from rl_core.config import load_config

    logger = get_run_logger()
    limits = load_thresholds(thresholds)
    ref = json.loads(_resolve(reference).read_text())
    out = Path(out_dir).resolve()
    overrides = run_overrides(out, mlflow_uri, list(overrides or []))
    cfg = load_config(REPO_ROOT / RECIPE, overrides)
    tracking_uri = resolve_tracking_uri(cfg)

    checks: list[Check] = []
    records: list[dict] = []
    summary: dict = {}
    training_run_id = None
    try:
        result = grpo(recipe=str(REPO_ROOT / RECIPE), overrides=overrides)
        training_run_id = result.get("mlflow_run_id")
        records = MetricsLog(result["metrics"]).read()
    except Exception as exc:  # noqa: BLE001 - a crashed run is itself the regression; checks 3 and 4 still run
        checks.append(Check("arithmetic.run", "fail", "crashed", "completes", f"{type(exc).__name__}: {exc}"[:500]))
    if records:
        summary = run_summary(records)
        checks += arithmetic_checks(summary, limits["arithmetic"])
        checks += trajectory_checks(records, ref, limits["trajectory"], model_sha256(cfg.model.name_or_path))
        checks += timing_checks(summary, limits["timing"])
    checks += objective_checks(limits["objectives"])
    checks += gsm8k_checks(limits["gsm8k_reward"])
    failed = [c for c in checks if c.status == "fail"]

    import torch

    sha, dirty = git_revision()
    meta = {"time_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "git_sha": sha, "git_dirty": dirty,
            "torch": torch.__version__, "training_run_id": training_run_id,
            "prefect_flow_run_id": str(flow_run.id) if flow_run.id else None}
    client, experiment_id = _client_and_experiment(tracking_uri)
    trend = previous_nights(client, experiment_id)
    final_loss = next((r["train/loss"] for r in reversed(records) if "train/loss" in r), None)
    tonight = {"date": meta["time_utc"][:16], "status": "failed" if failed else "passed",
               **{k: summary.get(k) for k in ("final_val_accuracy", "reward_mean_last5", "median_step_s",
                                              "median_tokens_per_s")},
               "final_loss": final_loss, "failed": ",".join(c.name for c in failed)}
    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    plot_trajectory(records, ref, report_dir / "trajectory.png")
    report = render_report(checks, summary, [tonight, *trend], meta)
    (report_dir / "report.md").write_text(report)
    (report_dir / "checks.json").write_text(json.dumps([asdict(c) for c in checks], indent=1))

    run = client.create_run(experiment_id, run_name=f"regression-{datetime.now(UTC):%Y%m%d-%H%M%S}", tags={
        KIND_TAG: "regression", "posttrain.regression.status": tonight["status"],
        "posttrain.regression.failed": tonight["failed"][:5000], "posttrain.git_sha": sha,
        "posttrain.git_dirty": dirty, "mlflow.source.git.commit": sha,
        **({"posttrain.training_run_id": training_run_id} if training_run_id else {}),
        **({"posttrain.prefect_flow_run_id": meta["prefect_flow_run_id"]} if meta["prefect_flow_run_id"] else {})})
    run_id = run.info.run_id
    try:
        metrics = {f"regression/{k}": v for k, v in {**summary, "final_loss": final_loss}.items()
                   if isinstance(v, (int, float)) and v is not None and math.isfinite(v)}
        metrics["regression/failed_checks"] = len(failed)
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value))
        for name in ("report.md", "trajectory.png", "checks.json"):
            client.log_artifact(run_id, str(report_dir / name), "report")
        client.log_artifact(run_id, str(_resolve(thresholds)), "report")
    finally:
        set_terminated(client, run_id, "FAILED" if failed else "FINISHED")  # its printed URI scrubbed

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
                    extra: list[str] | None = None) -> Path:
    """Run the fixed run (the grpo flow) and write its loss/grad-norm trajectory as the reference."""
    import torch

    from flows.entry import run_recipe
    from infra.tracking import git_revision, package_versions
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
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.regression", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-reference", action="store_true", help="regenerate regression/reference_trajectory.json")
    parser.add_argument("--thresholds", default=THRESHOLDS)
    parser.add_argument("--reference", default=REFERENCE)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    if args.write_reference:
        print(write_reference(_resolve(args.reference), args.out_dir or "runs/regression-reference"))
        return 0
    state = regression(thresholds=args.thresholds, reference=args.reference,
                       out_dir=args.out_dir or "runs/regression", return_state=True)
    print(state.message or state.name)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    sys.exit(main())
