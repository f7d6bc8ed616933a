"""The judge example's tables: the tiny judge's held-out verdicts, then GRPO with it as the only reward.

- The judge (`artifacts/tiny-model/judge`, built by `dvc repro pipelines/judge_arithmetic/dvc.yaml`): its verdict on
  every held-out row of `data/arithmetic-judge/val.jsonl` (each held-out sum's answer and the warm start's greedy
  wrong one, as requests), asked as a run asks it (`rl_core.rewards.judge.local_judge`), against the row's verdict.
- `recipes/judge_arithmetic.py`: one quiet `posttrain run` in a scratch directory (real Prefect, real local Ray), the
  recipe as it is; held-out accuracy by the exact-match rule it never sees (weight 0), the judge's mean held-out
  reward and the hacking flag, every 25 steps.

    python benchmarks/bench_judge.py [--rl-steps 300]
    python benchmarks/bench_judge.py --run runs/judge-arithmetic    # the tables of a finished run

`--run` reads a finished run's metrics instead of training (e.g. the one `dvc repro pipelines/judge_arithmetic/dvc.yaml`
trained); its wall time is then the sum of its steps' `perf/step_s`.
"""

from __future__ import annotations

import argparse
import json
import shutil

# benchmarks/ is this script's sys.path[0]
from bench_dynamic_sampling import REPO, run
from bench_pipeline import scratch_dir
from bench_rlhf import FINISHED, finished_run, first_and_last, missing_inputs, policy_rows
from report import write_section

JUDGE = REPO / "artifacts" / "tiny-model" / "judge"
ROWS = REPO / "data" / "arithmetic-judge" / "val.jsonl"


def verdicts() -> list[list[str]]:
    """The judge's held-out verdict table: per verdict (1 right, 0 wrong), rows, judged right, unparsable."""
    from recipes.judge_arithmetic import build_config
    from rl_core.rewards.judge import local_judge, parse_score

    spec = build_config().data.rewards[0].judge.model_copy(update={"model": str(JUDGE)})
    judge = local_judge(spec)
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    said = [parse_score(t) for start in range(0, len(rows), 256)
            for t in judge.generate([r["prompt"] for r in rows[start:start + 256]])]
    table = []
    for verdict in ("1", "0"):
        mine = [s for r, s in zip(rows, said, strict=True) if r["answer"] == verdict]
        table.append([verdict, str(len(mine)), f"{sum(s == float(verdict) for s in mine) / len(mine):.3f}",
                      f"{sum(s is None for s in mine) / len(mine):.3f}"])
    return table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rl-steps", type=int, default=300)
    parser.add_argument("--run", help="a finished run to report instead of training one")
    args = parser.parse_args()
    if missing_inputs([JUDGE / "model.safetensors", ROWS], "judge_arithmetic"):
        return 2
    table = verdicts()
    if args.run:
        rl, wall = finished_run(args.run)
        args.rl_steps, seconds = rl[-1]["step"], FINISHED
    else:
        workdir = scratch_dir()
        try:
            rl, wall = run(workdir, "judge_arithmetic", "judge", [], args.rl_steps)  # the checkout's judge, linked
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        seconds = "s wall"
    return report(args, table, rl, wall, seconds)


def report(args: argparse.Namespace, table: list[list[str]], rl: list[dict], wall: float, seconds: str) -> int:
    """Print the two tables and write them into docs/benchmarks.md."""
    rows = policy_rows(rl)
    for row in table:
        print("judge", " ".join(row), flush=True)
    for row in rows:
        print("rl", " ".join(row), flush=True)
    train = [r for r in rl if "rollout/rewards/judge/mean" in r]
    right = sum(int(r[1]) * float(r[2]) for r in table) / sum(int(r[1]) for r in table)
    write_section("judge-verdicts", ["verdict", "held-out rows", "judged right", "unparsable"], table,
                  [(f"`artifacts/tiny-model/judge` on `data/arithmetic-judge/val.jsonl`, greedy, as a run asks it: "
                   f"{right:.3f} of the verdicts right.")])
    write_section("judge", ["step", "held-out accuracy (exact match, weight 0)", "held-out judge reward",
                            "val/reward_hacking"], rows,
                  [(f"`recipes/judge_arithmetic.py`, {args.rl_steps} steps of 16 prompts x 8 completions, GRPO with the "
                   "judge above as the only reward; greedy exact match on all 500 held-out sums. Mean train-time "
                   f"exact match over the first and last 25 steps: {first_and_last(train)}; judge answers unparsable "
                   f"over the run: {sum(r['rollout/rewards/judge/unparsable'] for r in train) / len(train):.3f}; the "
                   f"run took {wall:.0f} {seconds}.")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
