"""`posttrain summarize | run-params`: the commands the DVC `train` and `evaluate` stages call.

    posttrain summarize RUN_DIR [--out-summary PATH] [--out-curve PATH]
        reads RUN_DIR/metrics.jsonl; writes a flat summary JSON (DVC metrics) and a curve JSON, a
        list of {step, reward_mean, accuracy} (DVC plots)
    posttrain run-params RECIPE [KEY=VALUE ...] [--params params.yaml] [--run-dir DIR]
        `posttrain run RECIPE` with the dotlist `run.overrides` of params.yaml, then KEY=VALUE

`run-params` exists because DVC cannot put a list parameter into a command (`${run.overrides}` is
refused: "Cannot interpolate data of type 'list'"), and params.yaml must stay the one owner of
the run's overrides.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

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
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((r["step"], float(v)))
    return out


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


def curve_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per logged step: `{step, reward_mean, accuracy}`, None where the step has no such value."""
    reward, accuracy = dict(_series(records, REWARD_KEY)), dict(_series(records, ACCURACY_KEY))
    steps = sorted({r["step"] for r in records})
    return [{"step": s, "reward_mean": reward.get(s), "accuracy": accuracy.get(s)} for s in steps]


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
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    print(f"summarize: {summary['steps']} steps, held-out val/accuracy {fmt(summary['initial_val_accuracy'])} before "
          f"training (the warm start, as built on this machine) -> {fmt(summary['final_val_accuracy'])} at step "
          f"{summary['final_val_step']}; summary -> {summary_path}, curve -> {curve_path}")
    return 0


def params_overrides(params_path: str | Path, key: str) -> list[str]:
    """The dotlist at `key` (dotted, e.g. `run.overrides`) of a params file; every item a `k=v` string."""
    import yaml

    path = Path(params_path)
    if not path.is_file():
        raise ValueError(f"{path}: no such params file")
    node: Any = yaml.safe_load(path.read_text()) or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{path}: no key {key!r}; set it to a list of overrides, e.g. [rl.max_steps=50]")
        node = node[part]
    if node is None:
        return []
    if not isinstance(node, list) or not all(isinstance(x, str) and "=" in x for x in node):
        raise ValueError(f"{path}: {key} must be a list of 'key=value' strings, got {node!r}")
    return list(node)


def cmd_run_params(args: argparse.Namespace) -> int:
    from rl_core.config import ConfigError, load_config
    from rl_core.redact import redact_message

    try:
        overrides = params_overrides(args.params, args.overrides_key) + list(args.fixed)
        if args.run_dir is not None:
            cfg = load_config(args.recipe, overrides)
            if Path(cfg.run_dir).resolve() != Path(args.run_dir).resolve():
                raise ValueError(f"the run directory is {cfg.run_dir!r} but this stage's outputs are under "
                                 f"{args.run_dir!r}; keep job.name/job.out_dir or change dvc.yaml")
        print(redact_message(f"run-params: posttrain run {args.recipe} -- {' '.join(overrides)}"), flush=True)
        from flows.entry import run_recipe

        run_recipe(args.recipe, overrides)
    except (ValueError, ConfigError) as exc:
        print(redact_message(f"posttrain run-params: {exc}"), file=sys.stderr)
        return 1
    return 0


def add_report_commands(subparsers) -> None:
    """Register `summarize` and `run-params` on `subparsers`."""
    p = subparsers.add_parser(
        "summarize", help="summary JSON (DVC metrics) and curve JSON (DVC plots) of a run directory"
    )
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl, e.g. runs/arithmetic")
    p.add_argument("--out-summary", default=None, help="summary JSON path (default RUN_DIR/summary.json)")
    p.add_argument("--out-curve", default=None, help="curve JSON path (default RUN_DIR/curve.json)")
    p.set_defaults(handler=cmd_summarize)

    p = subparsers.add_parser(
        "run-params", help="posttrain run RECIPE with the overrides of params.yaml (the DVC train stage)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (the overrides here come without `--`, after the params file's):\n"
               "  posttrain run-params recipes/arithmetic.py rl.optimizer.lr=2e-4 rl.max_steps=50 --run-dir "
               "runs/arithmetic")
    p.add_argument("recipe", help="recipes/<name>.py")
    p.add_argument("fixed", nargs="*", metavar="KEY=VALUE", help="overrides applied after the params file's")
    p.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    p.add_argument("--overrides-key", default="run.overrides", help="dotted key of the override list")
    p.add_argument("--run-dir", default=None, help="fail unless the resolved run directory is this one")
    p.set_defaults(handler=cmd_run_params)
