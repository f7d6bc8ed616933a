"""PPO with a critic beside the group-relative objectives, at equal generated tokens: held-out accuracy per step, wall
time, tokens.

The arithmetic quickstart (`recipes/arithmetic.py` from its warm start: greedy exact match on all 500 held-out sums
every 25 steps), once per objective, with the same seeds, each a quiet `posttrain run` in a scratch directory (real
Prefect, real local Ray):

- `legacy_pg`: the recipe as it is (16 prompts x 8 completions, the legacy policy gradient);
- `grpo`: the same with clipped GRPO (`rl.objective.type=grpo`);
- `ppo`: `recipes/ppo_arithmetic.py` (128 prompts x 1 completion, the critic's values as the baseline).

    python benchmarks/bench_ppo.py [--steps 300] [--only legacy_pg grpo ppo] [--target 0.93]
    python benchmarks/bench_ppo.py --recipe tool_arithmetic --steps 150 --target 0.9

`--recipe tool_arithmetic` runs the calculator agent (`recipes/tool_arithmetic.py`: 8 sums x 8 episodes of up to 3
turns, clipped GRPO) against PPO on 64 sums x 1 episode (the same warm start and schedule); its rows and warm start
come from `dvc repro pipelines/tool_arithmetic/dvc.yaml`; the section is `ppo-tool_arithmetic`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics

# benchmarks/ is this script's sys.path[0]
from bench_dynamic_sampling import REPO, build, run, summary
from bench_pipeline import scratch_dir
from report import write_section

PPO = "rl.objective={type: ppo, critic_lr: 0.0001, critic_warmup_steps: 5}"
MODES = {  # recipe -> mode -> (recipe file, overrides)
    "arithmetic": {"legacy_pg": ("arithmetic", []), "grpo": ("arithmetic", ["rl.objective.type=grpo"]),
                   "ppo": ("ppo_arithmetic", [])},
    "tool_arithmetic": {"grpo": ("tool_arithmetic", []),
                        "ppo": ("tool_arithmetic", [PPO, "rollout.n=1", "rollout.prompts_per_step=64"])},
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="arithmetic", choices=list(MODES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", nargs="+", help="modes to run (default: all of the recipe's)")
    parser.add_argument("--target", type=float, default=0.93, help="held-out accuracy to reach")
    args = parser.parse_args()
    if not build(args.recipe):
        return 2
    from rl_core.config import load_config

    modes = {k: v for k, v in MODES[args.recipe].items() if not args.only or k in args.only}
    workdir = scratch_dir()
    results = []
    try:
        for name, (recipe, overrides) in modes.items():
            cfg = load_config(str(REPO / "recipes" / f"{recipe}.py"), overrides)
            rows = cfg.rollout.prompts_per_step * cfg.rollout.n
            records, wall = run(workdir, recipe, f"ppo-{name}", overrides, args.steps)
            done = summary(name, records, wall, args.target, rows)
            done["shape"] = f"{cfg.rollout.prompts_per_step} x {cfg.rollout.n}"
            done["step_s"] = statistics.median(r["perf/step_s"] for r in records if "perf/step_s" in r)
            results.append(done)
            print(f"{name}: {' '.join(f'{s}:{a:.3f}' for s, a in done['evals'])} | reached {done['reached']} | "
                  f"{done['wall']:.0f} s | {done['tokens']:,.0f} tokens", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    steps = [s for s, _ in results[0]["evals"]]
    header = ["objective", "prompts x completions", *[f"step {s}" for s in steps], f"first step >= {args.target}",
              "run wall s", "median step s", "generated tokens"]
    table = []
    for r in results:
        accuracy = dict(r["evals"])
        table.append([r["name"], r["shape"], *[f"{accuracy[s]:.3f}" if s in accuracy else "-" for s in steps],
                      str(r["reached"]) if r["reached"] is not None else "-", f"{r['wall']:.0f}",
                      f"{r['step_s']:.2f}", f"{r['tokens']:,.0f}"])
    measure = "greedy exact match" if args.recipe == "arithmetic" else "greedy episodes' success"
    notes = [(f"`{args.recipe}`. Held-out accuracy: {measure} on the held-out split (`val/accuracy`) every 25 steps; "
              f"{args.steps} steps, one optimizer step each, job.seed 0 in every run. Generated tokens: every response "
              "token sampled over the run.")]
    write_section("ppo" if args.recipe == "arithmetic" else f"ppo-{args.recipe}", header, table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
