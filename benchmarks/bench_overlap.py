"""Overlap benchmark: steps per second of one separate HF engine with clipped GRPO, on-policy and with the rollouts
of later steps in flight (`rl.async_steps`), with and without weight syncs that land inside them
(`rollout.in_flight_updates`).

The runs sample from the tiny random-init model, which samples to `rollout.max_tokens` (96): 8 prompts x 4
completions a step, so generating a batch and training on it take comparable time on 2 cores (the columns show
both). Each mode is a quiet `posttrain run` of the arithmetic recipe (real Prefect, real local Ray) in a scratch
directory; the table has medians over the steps after warm-up (steps 4 on) and each mode's steps per second
relative to `rl.async_steps=0`, all from one invocation.

Then the learning check (`--no-accuracy` leaves it out): the arithmetic quickstart (its warm start, 16 prompts x 8
completions) with clipped GRPO for `--accuracy-steps` steps (300), on-policy and with `rl.async_steps=2`, and the
held-out accuracy of each at the end.

    python benchmarks/bench_overlap.py [--steps 30] [--accuracy-steps 300 | --no-accuracy]
"""

from __future__ import annotations

import argparse
import shutil
import statistics

from bench_pipeline import median, run, scratch_dir, wall_per_step  # benchmarks/ is this script's sys.path[0]

CLIPPED_SEPARATE = ["cluster.placement=separate", "rollout.num_engines=1", "rl.objective.type=grpo"]
BALANCED = ["model.name_or_path=artifacts/tiny-model/init", "rollout.max_tokens=96", "rollout.prompts_per_step=8",
            "rollout.n=4"]
MODES = {  # name -> (label, overrides)
    "sync": ("`rl.async_steps=0` (on-policy)", ["rl.async_steps=0"]),
    "async1": ("`rl.async_steps=1`", ["rl.async_steps=1"]),
    "async2": ("`rl.async_steps=2`", ["rl.async_steps=2"]),
    "async2-inflight": ("`rl.async_steps=2`, `rollout.in_flight_updates=true`",
                        ["rl.async_steps=2", "rollout.in_flight_updates=true"]),
}


def overlap_table(workdir, steps: int) -> list[list[str]]:
    rows, base = [], None
    for name, (label, overrides) in MODES.items():
        records, _, _ = run(workdir, f"overlap-{name}", [*CLIPPED_SEPARATE, *BALANCED, *overrides], steps)
        trained = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
        for r, wall in zip(trained, wall_per_step(workdir, f"bench-overlap-{name}", trained)):
            r["perf/wall_per_step_s"] = wall
        steady = [r for r in trained if r["step"] > 3]
        wall = median(steady, "perf/wall_per_step_s")
        base = base or wall
        rows.append([label, f"{1e3 * wall:.0f}", f"{1 / wall:.2f}", f"{base / wall:.2f}",
                     f"{1e3 * median(steady, 'perf/generate_s'):.0f}",
                     f"{1e3 * median(steady, 'perf/train_compute_s'):.0f}",
                     f"{1e3 * median(steady, 'perf/weight_sync_s'):.0f}",
                     f"{statistics.mean(r['rollout/policy_staleness'] for r in steady):.2f}",
                     f"{max(r['rollout/policy_staleness_max'] for r in steady):.0f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def accuracy_table(workdir, steps: int) -> list[list[str]]:
    rows = []
    for k in (0, 2):
        records, _, wall = run(workdir, f"accuracy-async{k}", [*CLIPPED_SEPARATE, f"rl.async_steps={k}"], steps)
        final = [r for r in records if "val/accuracy" in r][-1]
        rows.append([f"`rl.async_steps={k}`", str(final["step"]), f"{final['val/accuracy']:.3f}", f"{wall:.0f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> int:
    from report import table, write_section

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                        help="leave out the quickstart trained on-policy and with rl.async_steps=2")
    parser.add_argument("--accuracy-steps", type=int, default=300)
    args = parser.parse_args()
    workdir = scratch_dir()
    try:
        header = ["mode", "wall / step ms", "steps/s", "vs on-policy", "inside generate ms", "inside fwd/bwd ms",
                  "weight sync ms", "staleness mean", "staleness max"]
        print(" | ".join(header))
        rows = overlap_table(workdir, args.steps)
        notes = [f"Medians over steps 4..{args.steps}; staleness over the same steps."]
        if args.accuracy:
            acc_header = ["quickstart, clipped GRPO", "step", "held-out accuracy", "run s"]
            print(" | ".join(acc_header))
            notes.append(table(acc_header, accuracy_table(workdir, args.accuracy_steps)))
        write_section("overlap", header, rows, notes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
