"""Dynamic sampling and the curriculum on the quickstart (or the tool agent): held-out accuracy per optimizer step,
wall time, tokens.

Runs the arithmetic quickstart (`recipes/arithmetic.py` from its warm start, as `make demo` does: 16 prompts x 8
completions a step, the legacy policy gradient, greedy exact match on all 500 held-out sums every 25 steps) once per
mode below, with the same seeds, each a quiet `posttrain run` in a scratch directory (real Prefect, real local Ray):

- `baseline`: the recipe as it is (the epoch order, every group trained);
- `filter`: `rollout.filter_groups=true` (groups whose 8 rewards are all equal dropped, up to 3 extra rounds of the
  sampler's next prompts, the `train` fallback), so every step trains 16 groups that carry a signal where it can;
- `curriculum`: `data.sampler=curriculum` (prompts drawn by floor + p(1 - p) of their recent pass rate);
- `filter+curriculum`: both.

Each step is one optimizer step (the train fallback never skips one). Columns: held-out accuracy at every
evaluation; the first evaluated step at or above `--target` (0.93); the run's process wall seconds; the response
tokens generated (every round's); the mean extra rounds per step and share of generated groups kept.

    python benchmarks/bench_dynamic_sampling.py [--steps 300] [--only baseline filter ...] [--target 0.93]
    python benchmarks/bench_dynamic_sampling.py --recipe tool_arithmetic --steps 50 --target 0.9

The quickstart's tiny model and data are taken from the checkout when built (`make demo`), else built there first,
as `posttrain run recipes/arithmetic.py` builds them. `--recipe tool_arithmetic` runs the multi-turn calculator agent
(`recipes/tool_arithmetic.py`, episodes of up to 3 turns, success = the right sum) instead: its rows and warm start
come from `dvc repro pipelines/tool_arithmetic/dvc.yaml`; the section is `dynamic-sampling-tool_arithmetic`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

# benchmarks/ is this script's sys.path[0]
from bench_pipeline import QUIET_ENV, posttrain_command, scratch_dir
from report import write_section

REPO = Path(__file__).resolve().parents[1]
FILTER = ["rollout.filter_groups=true"]
CURRICULUM = ["data.sampler=curriculum"]
MODES = {  # name -> overrides
    "baseline": [],
    "filter": FILTER,
    "curriculum": CURRICULUM,
    "filter+curriculum": [*FILTER, *CURRICULUM],
}


def build(recipe: str) -> bool:
    """The recipe's data and warm start in the checkout: the quickstart's built where missing (params.yaml's values);
    another recipe's must be there (False, said, when not)."""
    from infra.artifacts import ensure_quickstart_artifacts
    from rl_core.config import load_config

    os.chdir(REPO)
    cfg = load_config(f"recipes/{recipe}.py")
    if recipe == "arithmetic":
        ensure_quickstart_artifacts(cfg)
        return True
    missing = [p for p in (cfg.model.name_or_path, cfg.data.train, cfg.data.val) if not (REPO / p).exists()]
    if missing:
        print(f"{', '.join(missing)} missing: dvc repro pipelines/{recipe}/dvc.yaml")
    return not missing


def run(workdir: Path, recipe: str, name: str, overrides: list[str], steps: int) -> tuple[list[dict], float]:
    """One quiet `posttrain run` of the recipe: its metrics records and the process's wall seconds."""
    job = f"bench-dyn-{name.replace('+', '-')}"
    cmd = [*posttrain_command(), "run", str(REPO / "recipes" / f"{recipe}.py"), "--", f"job.name={job}",
           f"rl.max_steps={steps}", *overrides, "rl.save_every=0", "rl.resume=off", "job.overwrite=true"]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=workdir, env={**os.environ, **QUIET_ENV}, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    lines = (workdir / "runs" / job / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall


def generated_tokens(record: dict, rows: int) -> float:
    """The response tokens a step generated: every round's with dynamic sampling, else its batch's."""
    if "rollout/filter/generated_tokens" in record:
        return record["rollout/filter/generated_tokens"]
    return record["rollout/response_len_mean"] * rows


def summary(name: str, records: list[dict], wall: float, target: float, rows: int) -> dict:
    evals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
    reached = next((s for s, a in evals if a >= target), None)
    filtered = [r for r in steps if "rollout/filter/rounds" in r]
    return {"name": name, "evals": evals, "reached": reached, "wall": wall,
            "tokens": sum(generated_tokens(r, rows) for r in steps),
            "rounds": sum(r["rollout/filter/rounds"] for r in filtered) / len(filtered) if filtered else 0.0,
            "kept": (sum(r["rollout/filter/kept_frac"] for r in filtered) / len(filtered)) if filtered else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", nargs="+", choices=list(MODES), help="modes to run (default: all)")
    parser.add_argument("--target", type=float, default=0.93, help="held-out accuracy to reach")
    parser.add_argument("--recipe", default="arithmetic", choices=["arithmetic", "tool_arithmetic"])
    args = parser.parse_args()
    if not build(args.recipe):
        return 2
    from rl_core.config import load_config

    cfg = load_config(str(REPO / "recipes" / f"{args.recipe}.py"))
    rows = cfg.rollout.prompts_per_step * cfg.rollout.n
    workdir = scratch_dir()
    try:
        results = []
        for name in args.only or list(MODES):
            records, wall = run(workdir, args.recipe, name, MODES[name], args.steps)
            results.append(summary(name, records, wall, args.target, rows))
            done = results[-1]
            print(f"{name}: {' '.join(f'{s}:{a:.3f}' for s, a in done['evals'])} | reached {done['reached']} | "
                  f"{done['wall']:.0f} s | {done['tokens']:,.0f} tokens", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    steps = [s for s, _ in results[0]["evals"]]
    header = ["mode", *[f"step {s}" for s in steps], f"first step >= {args.target}", "run wall s",
              "generated tokens", "extra rounds / step", "kept groups"]
    table = []
    for r in results:
        accuracy = dict(r["evals"])
        table.append([r["name"], *[f"{accuracy[s]:.3f}" if s in accuracy else "-" for s in steps],
                      str(r["reached"]) if r["reached"] is not None else "-", f"{r['wall']:.0f}",
                      f"{r['tokens']:,.0f}", f"{r['rounds']:.2f}", "-" if r["kept"] is None else f"{r['kept']:.2f}"])
    measure = "greedy exact match" if args.recipe == "arithmetic" else "greedy episodes' success"
    notes = [(f"`{args.recipe}`. Held-out accuracy: {measure} on {cfg.rl.validation.max_prompts or 'all'} of the held-out "
              f"split's sums (`val/accuracy`) every {cfg.rl.validation.every_steps} steps; {args.steps} steps of "
              f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n} completions, one optimizer step each, job.seed "
              f"{cfg.job.seed} in every mode. Generated tokens: every response token sampled, the extra rounds' "
              "included; kept groups: the share of generated groups whose rewards were not all equal.")]
    write_section("dynamic-sampling" if args.recipe == "arithmetic" else f"dynamic-sampling-{args.recipe}", header,
                  table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
