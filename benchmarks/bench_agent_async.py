"""An agent task trained asynchronously: whole steps per second and held-out success, `rl.async_steps=1` (episodes
scheduled per episode) vs on-policy lock-step, on the tool-use example (`recipes/tool_arithmetic.py`).

Each mode is a quiet `posttrain run` of the recipe in a scratch directory (real Prefect, real local Ray), one
separate HF engine (`cluster.placement=separate`, `rollout.num_engines=1`: what `rl.async_steps` needs, so every mode
has it), the recipe's seeds:

- `on-policy lock-step`: `rl.async_steps=0`, `rollout.episode_scheduling=lock_step`;
- `on-policy per-episode`: `rl.async_steps=0` (`--only` it: not run by default);
- `async 1`: `rl.async_steps=1`, episodes scheduled per episode (step s+1's episodes play while step s trains).

Held-out success is evaluated once, after the last step. Columns: the median step's seconds (`perf/step_s`: the step's phases, evaluation and checkpoints excluded), steps
per second from it, the speed-up over on-policy lock-step, held-out success (greedy, one episode per held-out row) at
the last evaluation, the mean token lag (`rollout/policy_staleness`) and the sampler-vs-trainer log-prob gap
(`rollout/logp_abs_diff`, median step: under `rl.async_steps` the trainer's weights are a version ahead of a stale
token's, so this is not a gap between equal weights).

    python benchmarks/bench_agent_async.py [--steps 150] [--recipe tool_arithmetic] [--only ...]

The example's rows and warm start are built first when missing (`dvc repro pipelines/<recipe>/dvc.yaml`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_pipeline import run, scratch_dir  # benchmarks/ is this script's sys.path[0]
from report import write_section

REPO = Path(__file__).resolve().parents[1]
SEPARATE = ["cluster.placement=separate", "rollout.num_engines=1"]
MODES = {  # name -> overrides
    "on-policy lock-step": [*SEPARATE, "rl.async_steps=0", "rollout.episode_scheduling=lock_step"],
    "on-policy per-episode": [*SEPARATE, "rl.async_steps=0"],
    "async 1": [*SEPARATE, "rl.async_steps=1"],
}
DEFAULT = ("on-policy lock-step", "async 1")
WARM = {"tool_arithmetic": "artifacts/tiny-model/tool-warm", "guess_number": "artifacts/tiny-model/guess-warm"}


def build(recipe: str) -> None:
    """The example's rows and warm start in the checkout, when missing (its DVC pipeline)."""
    if (REPO / WARM[recipe] / "config.json").is_file():
        return
    dvc = Path(sys.executable).with_name("dvc")
    subprocess.run([str(dvc) if dvc.exists() else "dvc", "repro", f"pipelines/{recipe}/dvc.yaml"], cwd=REPO,
                   check=True)


def summary(records: list[dict]) -> dict:
    steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
    evals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    step_s = statistics.median(r["perf/step_s"] for r in steps)
    return {"step_s": step_s, "evals": evals,
            "staleness": statistics.mean(r.get("rollout/policy_staleness", 0.0) for r in steps),
            "gap": statistics.median(r["rollout/logp_abs_diff"] for r in steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--recipe", choices=sorted(WARM), default="tool_arithmetic")
    parser.add_argument("--only", nargs="+", choices=list(MODES), help=f"modes to run (default: {', '.join(DEFAULT)})")
    args = parser.parse_args()
    os.chdir(REPO)
    build(args.recipe)
    workdir = scratch_dir()
    results = {}
    try:
        for name in args.only or DEFAULT:
            records, _, wall = run(workdir, "agent-" + name.replace(" ", "-"), MODES[name], args.steps,
                                   recipe=args.recipe)
            results[name] = {**summary(records), "wall": wall}
            done = results[name]
            print(f"{name}: median step {done['step_s']:.2f} s | {' '.join(f'{s}:{a:.3f}' for s, a in done['evals'])}"
                  f" | {wall:.0f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = results.get("on-policy lock-step", next(iter(results.values())))["step_s"]
    header = ["mode", "median step s", "steps/s", "speed-up", "held-out success (last)", "mean token lag",
              "logp_abs_diff (median)", "run wall s"]
    table = [[name, f"{r['step_s']:.2f}", f"{1 / r['step_s']:.3f}", f"{base / r['step_s']:.2f}×",
              f"{r['evals'][-1][1]:.3f} (step {r['evals'][-1][0]})" if r["evals"] else "-", f"{r['staleness']:.2f}",
              f"{r['gap']:.1e}", f"{r['wall']:.0f}"] for name, r in results.items()]
    notes = [(f"`recipes/{args.recipe}.py`, {args.steps} steps, one separate HF engine in every mode (float32); the "
              "sampler-vs-trainer gap of each token against the weights that sampled it is checked to 1e-5 by "
              "tests/rl_core/test_async_episodes.py.")]
    write_section("agent-async", header, table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
