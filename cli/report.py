"""`posttrain summarize`: what the DVC `summarize` stage calls.

    posttrain summarize RUN_DIR [--out-summary PATH] [--out-curve PATH] [--out-png PATH]
        reads RUN_DIR/metrics.jsonl; writes a flat summary JSON (DVC metrics), a curve JSON, one
        {step, <metric>...} point per step for the panels of `infra.tracking.plots` (DVC plots; a metric key's
        `/` becomes `_`: `rollout/reward_mean` -> `rollout_reward_mean`), and optionally the figure
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infra.tracking.plots import PANELS, curve_title, plot_curve, series
from rl_core.data.jsonl import iter_jsonl

REWARD_KEY = "rollout/reward_mean"
ACCURACY_KEY = "val/accuracy"
LOSS_KEY = "train/loss"
# what the training loop spent on each step; evaluation and checkpointing are timed apart
LOOP_TIME_KEYS = ("perf/step_s", "perf/evaluate_s", "perf/checkpoint_s")


class MetricsFileError(ValueError):
    pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order; every one must carry an integer `step`."""
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"{path}: no such file; summarize reads the metrics.jsonl of a training run")
    records = []
    try:
        for lineno, record in iter_jsonl(path, "a metrics record"):
            if not isinstance(record.get("step"), int):
                raise MetricsFileError(f"{path}:{lineno}: a metrics record needs an integer 'step'")
            records.append(record)
    except ValueError as exc:  # MetricsFileError, or iter_jsonl's line that is not a JSON object
        raise MetricsFileError(str(exc)) from None
    if not records:
        raise MetricsFileError(f"{path}: no metrics records")
    return records


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """`(step, value)` for every record with a finite number under `key`."""
    return list(zip(*series(records, key), strict=True))


def _last(series: list[tuple[int, float]]) -> float | None:
    return series[-1][1] if series else None


def _mean(series: list[tuple[int, float]]) -> float | None:
    return sum(v for _, v in series) / len(series) if series else None


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A flat summary of one run's metrics; a value the run never logged is None.

    Training steps are the records with step >= 1 (step 0 is the evaluation before training).
    `train_loop_s` is the summed perf/step_s + perf/evaluate_s + perf/checkpoint_s: the loop's
    own time, without process, Ray and Prefect start-up.
    """
    train_steps = sorted({r["step"] for r in records if r["step"] >= 1})
    accuracy = _series(records, ACCURACY_KEY)
    reward = _series(records, REWARD_KEY)
    loss = _series(records, LOSS_KEY)
    step_s = _series(records, "perf/step_s")
    best = max(accuracy, key=lambda sv: sv[1]) if accuracy else None  # max() keeps the earliest tie
    initial = [v for s, v in accuracy if s == 0]
    return {
        "steps": len(train_steps),
        "final_step": max(r["step"] for r in records),
        "initial_val_accuracy": initial[0] if initial else None,
        "final_val_accuracy": _last(accuracy),
        "final_val_step": accuracy[-1][0] if accuracy else None,
        "best_val_accuracy": best[1] if best else None,
        "best_val_step": best[0] if best else None,
        "final_reward_mean": _last(reward),
        "mean_reward_mean": _mean(reward),
        "final_train_loss": _last(loss),
        "mean_train_loss": _mean(loss),
        "mean_step_s": _mean(step_s),
        "train_loop_s": sum(v for key in LOOP_TIME_KEYS for _, v in _series(records, key)),
    }


def curve_field(key: str) -> str:
    """The curve.json field of a metrics key: `rollout/reward_mean` -> `rollout_reward_mean`."""
    return key.replace("/", "_")


def curve_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per logged step: `{step, <field>: value}` for every metric of the figure's panels (`infra.tracking.plots`),
    None where the step has no such value: every run has the same fields, so `dvc plots` compares any two."""
    keys = [k for p in PANELS for k in (*p.keys, *((p.band,) if p.band else ()))]
    values = {k: dict(zip(*series(records, k), strict=True)) for k in keys}
    steps = sorted({r["step"] for r in records})
    return [{"step": s, **{curve_field(k): v.get(s) for k, v in values.items()}} for s in steps]


def _run_title(run_dir: Path) -> str | None:
    """`job.name — objective` from the run's config_resolved.yaml, if it has one."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config_resolved.yaml").read_text()) or {}
        return curve_title(cfg["job"]["name"], cfg["rl"]["objective"]["type"])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def cmd_summarize(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except MetricsFileError as exc:
        print(f"posttrain summarize: {exc}", file=sys.stderr)
        return 1
    summary = summarize_records(records)
    summary_path = Path(args.out_summary or run_dir / "summary.json")
    curve_path = Path(args.out_curve or run_dir / "curve.json")
    _write_json(summary_path, summary)
    _write_json(curve_path, curve_points(records))
    if args.out_png:
        plot_curve(records, args.out_png, _run_title(run_dir) or run_dir.name)
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    print(f"summarize: {summary['steps']} steps, held-out val/accuracy {fmt(summary['initial_val_accuracy'])} before "
          f"training (the warm start, as built on this machine) -> {fmt(summary['final_val_accuracy'])} at step "
          f"{summary['final_val_step']}; summary -> {summary_path}, curve -> {curve_path}"
          + (f", figure -> {args.out_png}" if args.out_png else ""))
    return 0


def add_report_commands(subparsers) -> None:
    """Register `summarize` on `subparsers`."""
    p = subparsers.add_parser(
        "summarize", help="summary JSON (DVC metrics) and curve JSON (DVC plots) of a run directory"
    )
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl, e.g. runs/arithmetic")
    p.add_argument("--out-summary", default=None, help="summary JSON path (default RUN_DIR/summary.json)")
    p.add_argument("--out-curve", default=None, help="curve JSON path (default RUN_DIR/curve.json)")
    p.add_argument("--out-png", default=None, help="also draw the training-curves figure (PNG) to this path")
    p.set_defaults(handler=cmd_summarize)

