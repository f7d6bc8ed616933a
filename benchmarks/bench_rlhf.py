"""The RLHF example's learning tables: a reward model trained on preference pairs, then GRPO with it as the only reward.

Two quiet `posttrain run`s in a scratch directory (real Prefect, real local Ray), with the recipes as they are:

- `recipes/rm_arithmetic.py`: the reward model on `data/arithmetic-rm-pairs` (`dvc repro
  pipelines/rlhf_arithmetic/dvc.yaml`, or the `rm_pairs` stage's command); its held-out pair accuracy and loss
  every `rl.validation.every_steps` steps;
- `recipes/rlhf_arithmetic.py`: the policy, rewarded by that model alone; held-out accuracy by the exact-match rule
  it never sees (weight 0), the reward model's mean held-out score and the hacking flag, every 25 steps.

    python benchmarks/bench_rlhf.py [--rm-steps 4000] [--rl-steps 300]
    python benchmarks/bench_rlhf.py --runs runs/rm-arithmetic runs/rlhf-arithmetic   # the tables of finished runs

`--runs` reads the two runs' metrics instead of training (e.g. those `dvc repro pipelines/rlhf_arithmetic/dvc.yaml`
trained); their wall time is then the sum of their steps' `perf/step_s`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# benchmarks/ is this script's sys.path[0]
from bench_dynamic_sampling import REPO, run
from bench_pipeline import scratch_dir
from report import write_section

PAIRS = REPO / "data" / "arithmetic-rm-pairs"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rm-steps", type=int, default=4000)
    parser.add_argument("--rl-steps", type=int, default=300)
    parser.add_argument("--runs", nargs=2, metavar=("RM_RUN", "RLHF_RUN"), help="finished runs to report instead")
    args = parser.parse_args()
    if args.runs:
        (rm, rm_wall), (rl, rl_wall) = (finished_run(d) for d in args.runs)
        args.rm_steps, args.rl_steps = rm[-1]["step"], rl[-1]["step"]
        return report(args, rm, rm_wall, rl, rl_wall, FINISHED)
    if missing_inputs([PAIRS / "train.jsonl", PAIRS / "val.jsonl"], "rlhf_arithmetic"):
        return 2
    workdir = scratch_dir()
    try:
        rm, rm_wall = run(workdir, "rm_arithmetic", "rm", [], args.rm_steps)
        rewards = (f"data.rewards=[{{model: '{workdir}/runs/bench-dyn-rm', name: rm}}, "
                   "{path: 'rl_core.rewards.arithmetic:exact_match', weight: 0.0, name: arithmetic}]")
        rl, rl_wall = run(workdir, "rlhf_arithmetic", "rlhf", [rewards], args.rl_steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return report(args, rm, rm_wall, rl, rl_wall, "s wall")


def report(args: argparse.Namespace, rm: list[dict], rm_wall: float, rl: list[dict], rl_wall: float,
           seconds: str) -> int:
    """Print the two learning tables and write them into docs/benchmarks.md."""
    rm_rows = [[str(r["step"]), f"{r['val/accuracy']:.3f}", f"{r['val/loss']:.3f}", f"{r['val/margin']:.2f}"]
               for r in rm if "val/accuracy" in r]
    rl_rows = policy_rows(rl)
    for row in rm_rows:
        print("rm", " ".join(row), flush=True)
    for row in rl_rows:
        print("rlhf", " ".join(row), flush=True)
    train = [r for r in rl if "rollout/rewards/rm/mean" in r]
    write_section("rlhf-rm", ["step", "held-out pair accuracy", "held-out loss", "held-out margin"], rm_rows,
                  [(f"`recipes/rm_arithmetic.py`, {args.rm_steps} steps of 64 pairs: held-out pairs of the warm model's "
                   f"greedy wrong answers (or a digit off); the run took {rm_wall:.0f} {seconds}.")])
    write_section("rlhf", ["step", "held-out accuracy (exact match, weight 0)", "held-out reward-model score",
                           "val/reward_hacking"], rl_rows,
                  [(f"`recipes/rlhf_arithmetic.py`, {args.rl_steps} steps of 16 prompts x 8 completions, GRPO with the "
                   "reward model above as the only reward; greedy exact match on all 500 held-out sums. Mean "
                   f"train-time exact match over the first and last 25 steps: {first_and_last(train)}; the run took "
                   f"{rl_wall:.0f} {seconds}.")])
    return 0


FINISHED = "s summed over its steps"  # how a finished run's wall time is counted (`finished_run`)


def finished_run(run_dir: str | Path) -> tuple[list[dict], float]:
    """A finished run's metrics records, and its wall time as the sum of its steps' `perf/step_s`."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return records, sum(r.get("perf/step_s", 0.0) for r in records)


def missing_inputs(paths: list[Path], pipeline: str) -> bool:
    """Whether any of `paths`, or the warm start and held-out data every policy run here reads, is missing (then
    printed, with the DVC pipeline that builds them)."""
    missing = [p for p in (*paths, REPO / "artifacts/tiny-model/warm", REPO / "data/arithmetic/val.jsonl")
               if not p.exists()]
    if missing:
        print(f"{', '.join(map(str, missing))} missing: dvc repro pipelines/{pipeline}/dvc.yaml")
    return bool(missing)


def policy_rows(records: list[dict]) -> list[list[str]]:
    """The policy's learning table: per held-out evaluation, its step, accuracy (the rule), mean learned reward and
    hacking flag."""
    return [[str(r["step"]), f"{r['val/accuracy']:.3f}", f"{r['val/mean_reward']:.3f}", f"{r['val/reward_hacking']:.0f}"]
            for r in records if "val/accuracy" in r]


def first_and_last(train: list[dict], n: int = 25) -> str:
    """The mean train-time exact match over the first and the last `n` steps, `a -> b`."""
    mean = lambda rows: sum(r["rollout/rewards/arithmetic/mean"] for r in rows) / len(rows)
    return f"{mean(train[:n]):.3f} -> {mean(train[-n:]):.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
