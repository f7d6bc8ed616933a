"""Pipeline benchmark: seconds per step and per phase, rollout tokens/s, weight sync, peak memory, overhead.

Runs the arithmetic quickstart flow (real Prefect, real local Ray; 16 prompts x 8 completions of
at most 4 tokens a step) in a scratch directory, once per placement below, and prints a table of
medians over the steps after warm-up:

- trainer ranks 1 and 2, engines colocated (the default): the HF engine samples from the trainer's
  own weights, so a sync moves no bytes; and 1 rank with 2 torch threads (`cluster.cpus_per_worker=2`,
  every core of a 2-core machine; the default is 1 a rank);
- separate HF engines, 1 and 2: rank 0 broadcasts every policy version to them over gloo;
- one separate HF engine with clipped GRPO, on-policy and with `rl.async_steps=1` (step k+1's rollout
  overlapped with step k's training);
- vLLM's CPU build, when it is installed: colocated in 1 and 2 trainer ranks (each rank streams its
  weights into its own engine in process: no bytes over a network), and separate engines, 1 and 2.

Columns: `step` is `perf/step_s`, the six phases' wall time; `wall/step` the loop's whole step, the
writing of its metrics (metrics.jsonl, MLflow) included (from MLflow's timestamps; `wall_per_step`);
`generate` is the time inside the engines (the slowest one; they run in parallel); `rollout tok/s` =
response tokens sampled / generate time; `sync` and `sync MB` the weight sync of one step and the
bytes each engine received; `overhead` = step wall time - generate time - the trainer's
forward/backward/optimizer time (overlapped, `rl.async_steps=1`: the longer of the two).

A second table is the start-up of each run: the seconds from the start of the `posttrain run` process to
each mark (`perf/startup/*` of step 1; flows/startup.py): `imports`, `flow` (the Prefect API up, the flow
run created, the local Ray started beside it, the trainer actors started in it), `inputs` (data, tokenizer,
resume plan), `tracking` (the MLflow run), `cluster` (the actors ready with their models), `first_rollout`
(after a resume's restore and the first weight sync).

    python benchmarks/bench_pipeline.py [--steps 30] [--only colocated-w1 separate-hf-e2 ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reward", "annotate", "validate", "train", "sync")
# a `posttrain run` subprocess without Prefect/Ray chatter or telemetry (bench_vs_trl uses it too)
QUIET_ENV = {"PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
             "RAY_USAGE_STATS_ENABLED": "0"}
STARTUP = ("imports", "flow", "inputs", "tracking", "cluster", "first_rollout")  # flows/startup.py, in order
COMPLETIONS_PER_STEP = 16 * 8  # recipes/arithmetic.py: prompts_per_step x n

CLIPPED = ["rl.objective.type=grpo"]  # rl.async_steps needs pi_old: clipped GRPO
CONFIGS = {  # name -> overrides
    "colocated-w1": ["cluster.num_workers=1"],
    "colocated-w1-t2": ["cluster.num_workers=1", "cluster.cpus_per_worker=2"],
    "colocated-w2": ["cluster.num_workers=2"],
    "separate-hf-e1": ["cluster.placement=separate", "rollout.num_engines=1"],
    "separate-hf-e2": ["cluster.placement=separate", "rollout.num_engines=2"],
    "separate-hf-e1-clipped": ["cluster.placement=separate", "rollout.num_engines=1", *CLIPPED],
    "separate-hf-e1-async": ["cluster.placement=separate", "rollout.num_engines=1", *CLIPPED, "rl.async_steps=1"],
    "colocated-vllm-w1": ["cluster.num_workers=1", "rollout.backend=vllm"],
    "colocated-vllm-w2": ["cluster.num_workers=2", "rollout.backend=vllm"],
    "separate-vllm-e1": ["cluster.placement=separate", "rollout.num_engines=1", "rollout.backend=vllm"],
    "separate-vllm-e2": ["cluster.placement=separate", "rollout.num_engines=2", "rollout.backend=vllm"],
}


def posttrain_command() -> list[str]:
    """The `posttrain` console script of this interpreter's environment (bench_vs_trl uses it too)."""
    beside = Path(sys.executable).with_name("posttrain")
    found = str(beside) if beside.exists() else shutil.which("posttrain")
    if found is None:
        raise SystemExit("the `posttrain` command is not installed in this environment: pip install -e .")
    return [found]


def run(workdir: Path, name: str, overrides: list[str], steps: int,
        env: dict[str, str] | None = None, recipe: str = "arithmetic") -> tuple[list[dict], float, float]:
    """One quiet `posttrain run` of the arithmetic quickstart (or another `recipe`) in `workdir` (`env`: more
    variables): its metrics records, the children's peak RSS in MB and the process's wall seconds."""
    env = {**os.environ, **QUIET_ENV, **(env or {})}
    cmd = [*posttrain_command(), "run", str(REPO / "recipes" / f"{recipe}.py"), "--",
           f"job.name=bench-{name}", f"rl.max_steps={steps}", *overrides,
           "rl.validation.before_training=false", f"rl.validation.every_steps={steps}", "rl.save_every=0",
           "rl.resume=off", "job.overwrite=true"]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (workdir / "runs" / f"bench-{name}" / "metrics.jsonl").read_text()
               .splitlines()]
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return records, peak_mb, wall


def scratch_dir() -> Path:
    """A scratch working directory for the runs, with the checkout's built tiny model and data when present."""
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    for sub in ("artifacts", "data"):
        if (REPO / sub).exists():
            os.symlink(REPO / sub, workdir / sub)
    os.symlink(REPO / "params.yaml", workdir / "params.yaml")
    return workdir


def wall_per_step(workdir: Path, run_name: str, records: list[dict]) -> list[float]:
    """Each step's wall seconds in the loop, evaluation and checkpoint excluded: `perf/step_s` times the phases
    only, not the writing of the step's metrics (metrics.jsonl, MLflow) that follows them, so this reads MLflow's
    timestamp of every step's metrics (taken as each step's write starts, ms) from the run's store and takes the
    gaps between them, less the `perf/evaluate_s` and `perf/checkpoint_s` inside each gap. Step 1's is its
    `perf/step_s`. One value per record of `records` (the steps, in order)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + str(workdir.resolve() / "mlflow.db"))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                f"tags.mlflow.runName = '{run_name}'", max_results=1)
    stamps = {m.step: m.timestamp / 1e3 for m in client.get_metric_history(run.info.run_id, "perf/step_s")}
    walls, previous = [], None
    for r in records:
        at = stamps[r["step"]]
        walls.append(r["perf/step_s"] if previous is None else
                     at - previous - r.get("perf/evaluate_s", 0.0) - r.get("perf/checkpoint_s", 0.0))
        previous = at
    return walls


def median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r and r[key] is not None]
    return statistics.median(values) if values else float("nan")


def rollout_tokens_per_s(records: list[dict]) -> float:
    rates = [r["rollout/response_len_mean"] * COMPLETIONS_PER_STEP / r["perf/generate_s"]
             for r in records if r.get("perf/generate_s")]
    return statistics.median(rates) if rates else float("nan")


LABELS = {  # the section's names of CONFIGS
    "colocated-w1": "colocated, 1 rank (default)",
    "colocated-w1-t2": "colocated, 1 rank, 2 torch threads",
    "colocated-w2": "colocated, 2 ranks",
    "separate-hf-e1": "separate HF, 1 engine",
    "separate-hf-e2": "separate HF, 2 engines",
    "separate-hf-e1-clipped": "separate HF, 1 engine, clipped GRPO",
    "separate-hf-e1-async": "same, `rl.async_steps=1`",
    "colocated-vllm-w1": "colocated vLLM-CPU, 1 rank",
    "colocated-vllm-w2": "colocated vLLM-CPU, 2 ranks",
    "separate-vllm-e1": "separate vLLM-CPU, 1 engine",
    "separate-vllm-e2": "separate vLLM-CPU, 2 engines",
}


def report(rows: list, steps: int) -> None:
    """docs/benchmarks.md's section: the step table's main columns, start-up to the first rollout as a note."""
    from report import write_section  # benchmarks/ is this script's sys.path[0]

    header = ["placement", "step ms", "wall / step ms", *[f"{p} ms" for p in PHASES], "inside generate ms",
              "rollout tokens/s", "inside fwd/bwd ms", "weight sync ms", "MB / sync", "overhead ms"]
    table = []
    for name, steady, _, _, _ in rows:
        table.append([LABELS.get(name, name), f"{1e3 * median(steady, 'perf/step_s'):.0f}",
                      f"{1e3 * median(steady, 'perf/wall_per_step_s'):.0f}",
                      *[f"{1e3 * median(steady, f'perf/{p}_s'):.0f}" for p in PHASES],
                      f"{1e3 * median(steady, 'perf/generate_s'):.0f}", f"{rollout_tokens_per_s(steady):,.0f}",
                      f"{1e3 * median(steady, 'perf/train_compute_s'):.0f}",
                      f"{1e3 * median(steady, 'perf/weight_sync_s'):.0f}",
                      f"{median(steady, 'perf/weight_sync_bytes') / 1e6:.2f}",
                      f"{1e3 * median(steady, 'perf/overhead_s'):.0f}"])
    startup = ", ".join(f"{LABELS.get(name, name)} {first.get('perf/startup/first_rollout_s', float('nan')):.1f} s"
                        for name, _, _, first, _ in rows)
    write_section("pipeline", header, table,
                  [f"Medians over steps 4..{steps - 1}. First rollout after the process started: {startup}."])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="placements to run (default: all)")
    args = parser.parse_args()
    names = args.only or list(CONFIGS)
    if importlib.util.find_spec("vllm") is None:
        skipped = [n for n in names if "vllm" in n]
        names = [n for n in names if "vllm" not in n]
        if skipped:
            print(f"(vLLM is not installed: {', '.join(skipped)} not run)")
    workdir = scratch_dir()
    try:
        rows = []
        for name in names:
            records, peak_mb, wall = run(workdir, name, CONFIGS[name], args.steps)
            steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
            for r, step_wall in zip(steps, wall_per_step(workdir, f"bench-{name}", steps)):
                r["perf/wall_per_step_s"] = step_wall  # the benchmark's own figure, not a logged metric
            steady = [r for r in records if r.get("step", 0) > 3 and "val/accuracy" not in r]
            rows.append((name, steady, peak_mb, records[0], wall))
        header = ["placement", "step ms", "wall/step ms", *[f"{p} ms" for p in PHASES], "generate ms", "rollout tok/s",
                  "fwd/bwd ms", "weight sync ms", "sync MB", "overhead ms", "train tok/s", "peak RSS MB"]
        print(" | ".join(header))
        print(" | ".join("---" for _ in header))
        for name, steady, peak_mb, _, _ in rows:
            cells = [name, f"{1e3 * median(steady, 'perf/step_s'):.1f}",
                     f"{1e3 * median(steady, 'perf/wall_per_step_s'):.1f}"]
            cells += [f"{1e3 * median(steady, f'perf/{p}_s'):.1f}" for p in PHASES]
            cells += [f"{1e3 * median(steady, 'perf/generate_s'):.1f}", f"{rollout_tokens_per_s(steady):,.0f}",
                      f"{1e3 * median(steady, 'perf/train_compute_s'):.1f}",
                      f"{1e3 * median(steady, 'perf/weight_sync_s'):.1f}",
                      f"{median(steady, 'perf/weight_sync_bytes') / 1e6:.2f}",
                      f"{1e3 * median(steady, 'perf/overhead_s'):.1f}", f"{median(steady, 'perf/tokens_per_s'):,.0f}",
                      f"{peak_mb:,.0f}"]
            print(" | ".join(cells))
        print(f"(medians over steps 4..{args.steps - 1}; peak RSS is the largest child process so far)")
        print()
        header = ["placement", *[f"{m} s" for m in STARTUP], "process wall s"]
        print(" | ".join(header))
        print(" | ".join("---" for _ in header))
        for name, _, _, first, wall in rows:
            print(" | ".join([name, *[f"{first.get(f'perf/startup/{m}_s', float('nan')):.2f}" for m in STARTUP],
                              f"{wall:.1f}"]))
        print(f"(seconds since the posttrain process started; the run is {args.steps} steps, with one evaluation)")
        report(rows, args.steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
