"""Pipeline benchmark: seconds per step and per phase, tokens/s, peak memory and orchestration overhead.

Runs the arithmetic quickstart flow (real Prefect, real local Ray) for a few steps with 1 and 2
policy workers in a scratch directory and prints a table of medians over the steps after warm-up.
Orchestration overhead = step wall time - time inside generate - time inside the trainer's step
(forward, backward, optimizer). Target: <= 50 ms per step.

    python benchmarks/bench_pipeline.py [--steps 40] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reward", "annotate", "validate", "train", "sync")


def run(workdir: Path, workers: int, steps: int) -> tuple[list[dict], float]:
    name = f"bench-w{workers}"
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / "recipes" / "arithmetic.py"), "--",
           f"job.name={name}", f"rl.max_steps={steps}", f"cluster.num_workers={workers}",
           "rl.validation.before_training=false", f"rl.validation.every_steps={steps}", "rl.save_every=0",
           "rl.resume=off", "job.overwrite=true"]
    subprocess.run(cmd, cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return records, peak_mb


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r and r[key] is not None]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    for sub in ("artifacts", "data"):
        if (REPO / sub).exists():
            os.symlink(REPO / sub, workdir / sub)  # reuse a built tiny model/data when present
    try:
        rows = []
        for workers in args.workers:
            records, peak_mb = run(workdir, workers, args.steps)
            steady = [r for r in records if r.get("step", 0) > 3 and "val/accuracy" not in r]
            rows.append((workers, steady, peak_mb))
        header = ["workers", "step ms", *[f"{p} ms" for p in PHASES], "generate ms", "fwd/bwd ms", "overhead ms",
                  "tokens/s", "peak RSS MB"]
        print(" | ".join(header))
        print(" | ".join("---" for _ in header))
        for workers, steady, peak_mb in rows:
            cells = [str(workers), f"{1e3 * median(steady, 'perf/step_s'):.1f}"]
            cells += [f"{1e3 * median(steady, f'perf/{p}_s'):.1f}" for p in PHASES]
            cells += [f"{1e3 * median(steady, 'perf/generate_s'):.1f}", f"{1e3 * median(steady, 'perf/train_compute_s'):.1f}",
                      f"{1e3 * median(steady, 'perf/overhead_s'):.1f}", f"{median(steady, 'perf/tokens_per_s'):,.0f}",
                      f"{peak_mb:,.0f}"]
            print(" | ".join(cells))
        print(f"(medians over steps 4..{args.steps - 1}; peak RSS is the largest child process: driver or worker)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
