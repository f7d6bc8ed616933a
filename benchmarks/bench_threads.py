"""CPU threads and OpenMP's wait policy: what they do to a process that shares its cores, and to a user's step.

posttrain chooses the threads of each process role (infra/processes.py): the driver one torch thread, a trainer
rank or engine `cluster.cpus_per_worker` / `cpus_per_engine`, a reward worker one, a pytest worker one; and every
one of them runs OpenMP with OMP_WAIT_POLICY=PASSIVE, so that an idle thread sleeps instead of spinning on a core
another process needs. Two measurements:

1. **One process next to another.** The tiny model's HF `generate` (16 prompts, 4 new tokens) 30 times in a
   fresh process, alone and next to one busy process (a second process running the same loop without end),
   under three settings: torch's default threads (the machine's cores) with OpenMP's default wait policy,
   the same threads with OMP_WAIT_POLICY=PASSIVE, and one thread. Both processes run with the setting.
2. **A user's step.** The arithmetic quickstart through `posttrain run` (benchmarks/bench_pipeline.py's runs) in
   three placements, with posttrain's default (PASSIVE) and with OMP_WAIT_POLICY=ACTIVE (every idle OpenMP
   thread spins), which a user may still set: the median step wall time.

    python benchmarks/bench_threads.py [--steps 20] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_pipeline import REPO, median, run, wall_per_step  # benchmarks/ is this script's sys.path[0]

GENERATE = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, repeats = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
batch = tok([f"{a}+{b}=" for a, b in zip(range(10, 26), range(40, 56))], return_tensors="pt", padding=True)
def once():
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
once()
if repeats <= 0:  # the busy neighbour: until it is killed
    print("ready", flush=True)
    while True:
        once()
started = time.perf_counter()
for _ in range(repeats):
    once()
print(f"{time.perf_counter() - started:.3f} {torch.get_num_threads()}")
"""
# name -> the environment both processes run with (None: unset, OpenMP's own default)
SETTINGS = {
    "default threads, OpenMP's default wait policy": {"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": None},
    "default threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": None},
    "1 thread": {"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": "1"},
}
PLACEMENTS = {  # bench_pipeline's configs: which roles share the cores
    "colocated, 1 rank (default)": ["cluster.num_workers=1"],
    "colocated, 1 rank, 2 torch threads": ["cluster.num_workers=1", "cluster.cpus_per_worker=2"],
    "separate HF, 1 engine": ["cluster.placement=separate", "rollout.num_engines=1"],
}
POLICIES = ("PASSIVE", "ACTIVE")


def environment(setting: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in setting}
    env.update({k: v for k, v in setting.items() if v is not None})
    return env


def generate_seconds(model_dir: Path, setting: dict, repeats: int, neighbour: bool) -> tuple[float, int]:
    env = environment(setting)
    busy = None
    if neighbour:
        busy = subprocess.Popen([sys.executable, "-c", GENERATE, str(model_dir), "0"], env=env,
                                stdout=subprocess.PIPE, text=True)
        busy.stdout.readline()  # "ready": its model is loaded and it is generating
    try:
        out = subprocess.run([sys.executable, "-c", GENERATE, str(model_dir), str(repeats)], env=env,
                             capture_output=True, text=True, check=True, timeout=3600)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    seconds, threads = out.stdout.split()
    return float(seconds), int(threads)


def tiny_model(workdir: Path) -> Path:
    """The warm start when built in the checkout (`make demo`, `dvc repro`), else a freshly built random init."""
    warm = REPO / "artifacts" / "tiny-model" / "warm"
    if (warm / "config.json").is_file():
        return warm
    sys.path.insert(0, str(REPO))
    from rl_core.model.loading import build_tiny_model

    build_tiny_model(workdir / "tiny", seed=0)
    return workdir / "tiny"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-threads-"))
    model_dir = tiny_model(workdir)

    rows = []  # [measurement, setting, figure]

    def show(row):
        rows.append(row)
        print(" | ".join(str(c) for c in row), flush=True)

    for name, setting in SETTINGS.items():
        for neighbour in (False, True):
            seconds, threads = generate_seconds(model_dir, setting, args.repeats, neighbour)
            where = "next to a busy process" if neighbour else "alone"
            show([f"generate ×{args.repeats}, {where}", f"{name} ({threads})", f"{seconds:.2f} s"])

    for sub in ("artifacts", "data"):
        if (REPO / sub).exists():
            os.symlink(REPO / sub, workdir / sub)  # reuse a built tiny model/data when present
    os.symlink(REPO / "params.yaml", workdir / "params.yaml")
    saved = os.environ.get("OMP_WAIT_POLICY")
    try:
        for i, (label, overrides) in enumerate(PLACEMENTS.items()):
            for policy in POLICIES:
                os.environ["OMP_WAIT_POLICY"] = policy  # the run's own: posttrain passes it on to its actors
                name = f"threads-{i}-{policy.lower()}"
                records, _, _ = run(workdir, name, overrides, args.steps)
                steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
                wall = statistics.median(wall_per_step(workdir, f"bench-{name}", steps)[3:])
                setting = "PASSIVE (posttrain's default)" if policy == "PASSIVE" else f"{policy}, set by the user"
                show([f"quickstart step, {label}", setting,
                      f"{1e3 * wall:.0f} ms (phases {1e3 * median(steps[3:], 'perf/step_s'):.0f})"])
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = saved

    from report import write_section

    write_section("threads", ["measurement", "setting (torch threads)", "time"], rows, [
        (f"Generate: {args.repeats} greedy `generate` calls of the tiny model (16 prompts, 4 new tokens) in a fresh "
        "process, alone, and next to a second process running the same calls without end; both processes run "
        "with the row's setting."),
        (f"Quickstart step: median wall time of steps 4..{args.steps} of `posttrain run recipes/arithmetic.py` "
        "(`perf/step_s`, the six phases, in brackets), each role with posttrain's threads.")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
