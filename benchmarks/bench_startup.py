"""Start-up benchmark: seconds from `posttrain run` to each start-up mark and to the end of a 1-step run.

Runs the arithmetic quickstart for one step (no evaluation before training, one after, no checkpoint) in a
scratch directory, `--runs` times in each of two modes:

- `temporary API`: nothing set, as a newcomer runs it: `posttrain run` starts Prefect's temporary API server and
  a local Ray side by side (flows/entry.py);
- `running services`: with the variables of `posttrain services up` (a Prefect server and an MLflow server
  already running, started by this benchmark in the scratch directory, on free ports, after the first mode's runs,
  and stopped at the end), as a user who runs many short jobs would: the run starts no API server.

Columns are medians over the runs of each mark (`perf/startup/<mark>_s` of step 1, flows/startup.py: the age of
the `posttrain run` process): `imports` (the command's own imports), `local_ray` (Ray up), `prefect_api` (the
temporary API answering; none with the services), `flow` (the flow run created), `inputs` (data, tokenizer,
resume plan), `tracking` (the MLflow run), `cluster` (the trainer actors ready with their models, the reward
workers set up), `first_rollout`; and `1-step run`, the process's wall time, its end (the final evaluation, the
model logged to MLflow, the shutdown) included.

    python benchmarks/bench_startup.py [--runs 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_pipeline import run, scratch_dir
from report import write_section

MARKS = ("imports", "local_ray", "prefect_api", "flow", "inputs", "tracking", "cluster", "first_rollout")
ONE_STEP = ["rl.validation.before_training=false", "rl.validation.every_steps=1"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3, help="1-step runs per mode")
    args = parser.parse_args()
    from infra.services.supervisor import Services

    workdir = scratch_dir()
    services = Services.at(workdir / ".posttrain" / "services")
    results: dict[str, list[tuple[dict, float]]] = {"temporary API": [], "running services": []}
    try:
        for mode, runs in results.items():
            # the services run only for their own mode: their background work would load the other's runs
            env = services.up(prefect_port=0, mlflow_port=0, announce=lambda _: None) if mode != "temporary API" else {}
            for i in range(args.runs):
                records, _, wall = run(workdir, f"startup-{mode.split()[0]}-{i}", ONE_STEP, 1, env=env)
                runs.append((next(r for r in records if r.get("step") == 1 and "perf/startup/imports_s" in r), wall))
    finally:
        services.down(announce=lambda _: None)
        shutil.rmtree(workdir, ignore_errors=True)

    header = ["mode", *[f"{m} s" for m in MARKS], "1-step run s"]
    rows = []
    for mode, runs in results.items():
        cells = []
        for mark in MARKS:
            values = [first[f"perf/startup/{mark}_s"] for first, _ in runs if f"perf/startup/{mark}_s" in first]
            cells.append(f"{statistics.median(values):.1f}" if values else "-")
        rows.append([mode, *cells, f"{statistics.median(wall for _, wall in runs):.1f}"])
    write_section("startup", header, rows, [f"Medians of {args.runs} runs in each mode."])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
