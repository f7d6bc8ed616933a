"""GPU smoke test (`make gpu-smoke`): the GSM8K GRPO recipe with vLLM for 3 steps, on every layout the GPUs allow.

Needs a machine with at least one CUDA GPU and vLLM's GPU build (`pip install -e '.[gpu]'`). By
default it runs the tiny model (built on demand, with its warm start) on the arithmetic data it was
warm-started on, so that rewards vary and every step has a gradient; `--model DIR` runs a local
model directory instead, on a small GSM8K-shaped data set written here (chat template). It prints
the preflight memory plan, then runs `posttrain run recipes/grpo_gsm8k.py` (bf16 compute, float32
master weights) in each layout:

- 1 trainer rank on 1 GPU, vLLM colocated (always);
- 2 trainer ranks, FSDP, each with its own colocated vLLM (2 GPUs or more);
- 1 trainer rank and one separate vLLM engine over 2 GPUs, tensor_parallel_size=2 (3 GPUs or more);

and checks, from each run's own outputs:

- every trainer rank and engine ran on a CUDA device (`placement.json`);
- every step's loss and gradient norm are finite, some step had a gradient (rewards that differ
  within a group), and the run reached step 3;
- every weight sync was verified by what the engines hold (the flow stops on a mismatch: version,
  checksum, parameter sums, the probe's log-probs) and the probe's gap was logged
  (`rollout/sync_probe_logp_abs_diff`), at most the bf16 tolerance;
- the sampler-trainer log-prob difference (`rollout/logp_abs_diff`, mean |logp_vLLM - logp_trainer|
  over response tokens) is at most 0.05 nats in bf16 (also enforced by the flow:
  `rollout.max_logp_abs_diff`);
- colocated: vLLM gave back its memory for the train step in every step's sleep/wake/reload cycle (sleep
  level 2: GPU memory in use once it sleeps is below what it was at rollout by at least half its
  reservation), the sync woke it, and the memory in use neither asleep nor at rollout grew from the first
  cycle to the last (by more than `GROWTH_GIB`), and what it keeps asleep (its CUDA graphs and buffers,
  measured as it started: `placement.json`'s `vllm_asleep_resident_gib`) is within the memory plan's figure for the
  model it ran (`rl_core.placement.formulas.vllm_asleep_bytes`: scaled with the model, at least 1 GiB);
- every trainer rank trains with TF32 float32 matmuls (`placement.json`: precision "high"), a colocated
  vLLM's start notwithstanding;

and prints rollout and training tokens/s and the measured GPU memory next to the plan.

    python benchmarks/gpu_smoke.py [--model /path/to/model] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_core.placement.formulas import VLLM_ASLEEP_FLOOR_BYTES, vllm_asleep_bytes
from rl_core.rollout.verify import PROBE_ATOL  # the sync's own bound on the probe's gap

LOGP_DIFF_MAX = 0.05  # nats, mean over response tokens, bf16 sampler vs bf16-autocast trainer
UTILIZATION = 0.3  # rollout.gpu_memory_utilization of every run
PROMPTS, N = 8, 4
GROWTH_GIB = 0.25  # the most the GPU memory in use, asleep or at rollout, may grow from the first cycle to the last


def write_gsm8k_shaped(out: Path, n_train: int = 64, n_test: int = 16) -> None:
    """Word problems with the official fields and a `#### N` answer line."""
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                a, b = rng.randint(2, 60), rng.randint(2, 60)
                q = f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?"
                ans = f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"
                f.write(json.dumps({"question": q, "answer": ans}) + "\n")


def overrides(args: argparse.Namespace, data: Path, out_dir: Path, name: str, layout: dict[str, str]) -> list[str]:
    if args.model:
        write_gsm8k_shaped(data)
        task = [f"model.name_or_path={Path(args.model).resolve()}", f"data.train={data / 'train.jsonl'}",
                f"data.val={data / 'test.jsonl'}", "data.prompt_template=chat"]
    else:  # the tiny model and its own data (built by the flow when missing)
        task = ["model.name_or_path=artifacts/tiny-model/warm", "data.task=arithmetic",
                "data.train=data/arithmetic/train.jsonl", "data.val=data/arithmetic/val.jsonl",
                "data.prompt_template=plain"]
    cluster = {"cluster.num_workers": "1", "cluster.gpus_per_worker": "1", "cluster.cpus_per_worker": "2",
               "cluster.sharding": "none", **layout}
    return [
        f"job.name={name}", f"job.out_dir={out_dir}", "rl.resume=off", "job.overwrite=true", *task,
        *(f"{k}={v}" for k, v in cluster.items()),
        "rollout.backend=vllm", f"rollout.prompts_per_step={PROMPTS}", f"rollout.n={N}", "rollout.max_tokens=64",
        f"rollout.gpu_memory_utilization={UTILIZATION}", f"rollout.max_logp_abs_diff={LOGP_DIFF_MAX}",
        f"rl.max_steps={args.steps}", f"rl.save_every={args.steps}", f"rl.mini_batch_per_replica={PROMPTS * N // 2}",
        "rl.micro_batch_per_replica=8", "rl.optimizer.warmup_steps=0", "rl.validation.before_training=false",
        f"rl.validation.every_steps={args.steps}", "rl.validation.max_prompts=16",
    ]


def layouts(gpus: int) -> list[tuple[str, dict[str, str]]]:
    """(name, cluster overrides) of every layout this machine's GPUs allow."""
    out = [("colocated-1", {})]
    if gpus >= 2:
        out.append(("colocated-fsdp-2", {"cluster.num_workers": "2", "cluster.sharding": "fsdp",
                                          "cluster.cpus_per_worker": "1"}))
    if gpus >= 3:
        out.append(("separate-tp-2", {"cluster.placement": "separate", "rollout.num_engines": "1",
                                       "cluster.gpus_per_engine": "2"}))
    return out


def planned_asleep_gib(model_dir: Path) -> float:
    """The memory plan's figure for what the run's colocated vLLM keeps asleep, in GiB: for the model's shape in bf16
    (the recipe's compute dtype), or the floor when its config.json is not there."""
    from rl_core.placement.model_shape import model_shape

    shape = model_shape(str(model_dir))
    return (vllm_asleep_bytes(shape, 2) if shape is not None else VLLM_ASLEEP_FLOOR_BYTES) / 2**30


def check_run(run_dir: Path, steps_wanted: int, colocated: bool, gpu_gib: float,
              asleep_plan_gib: float = VLLM_ASLEEP_FLOOR_BYTES / 2**30) -> list[str]:
    """What is wrong with a finished run, read from its own outputs; prints its per-step table. `asleep_plan_gib`: the
    plan's figure for what its colocated vLLM keeps asleep (`planned_asleep_gib`)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    placement = json.loads((run_dir / "placement.json").read_text())
    failures = []
    devices = [role["device"] for group in placement.values() for role in group]
    if not devices or not all(d.startswith("cuda") for d in devices):
        failures.append(f"not every role ran on a GPU: {devices}")
    precision = [rank.get("float32_matmul_precision") for rank in placement.get("trainers", [])]
    if not precision or any(p != "high" for p in precision):
        failures.append(f"trainer ranks' float32 matmul precision {precision}: TF32 (\"high\") expected")
    if [r["step"] for r in steps] != list(range(1, steps_wanted + 1)):
        failures.append(f"steps logged {[r['step'] for r in steps]}, expected 1..{steps_wanted}")
    if not all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps):
        failures.append(f"non-finite loss or gradient norm: {[(r['train/loss'], r['train/grad_norm']) for r in steps]}")
    if not any(r["train/grad_norm"] > 0 for r in steps):
        failures.append("no step had a gradient (every group's rewards were equal): nothing was trained or synced")
    diffs = [r["rollout/logp_abs_diff"] for r in steps]
    if not all(d <= LOGP_DIFF_MAX for d in diffs):
        failures.append(f"sampler-trainer log-prob difference {diffs} exceeds {LOGP_DIFF_MAX}")
    probe = [r.get("rollout/sync_probe_logp_abs_diff") for r in steps]
    if not all(p is not None and p <= PROBE_ATOL['bfloat16'] for p in probe):
        failures.append(f"the weight sync's probe gap {probe} is missing or above {PROBE_ATOL['bfloat16']}")
    if colocated:
        freed = [r.get("perf/gpu_rollout_used_gib", 0) - r.get("perf/gpu_asleep_used_gib", math.inf) for r in steps]
        if not all(f >= 0.5 * UTILIZATION * gpu_gib for f in freed):
            failures.append(f"colocated vLLM gave back only {freed} GiB for the train step; its reservation is "
                            f"{UTILIZATION * gpu_gib:.1f} GiB (sleep level 2 frees weights and KV cache)")
        resident = [rank.get("vllm_asleep_resident_gib") for rank in placement.get("trainers", [])]
        if not resident or not all(r is not None and r <= asleep_plan_gib for r in resident):
            failures.append(f"the colocated vLLM engine keeps {resident} GiB on the GPU asleep; the memory plan counts "
                            f"{asleep_plan_gib:.2f} (rl_core.placement.formulas.vllm_asleep_bytes)")
        for key, what in (("perf/gpu_asleep_used_gib", "asleep"), ("perf/gpu_rollout_used_gib", "at rollout")):
            used = [r.get(key, math.nan) for r in steps]
            if steps and not used[-1] - used[0] <= GROWTH_GIB:  # NaN fails too
                failures.append(f"GPU memory in use {what} grew over the sleep/wake cycles: {used} GiB")
    print("\nstep | reward | loss | grad norm | logp diff (mean/max) | probe gap | weight sync s | rollout tok/s | "
          "train tok/s | GPU used at rollout / asleep GiB | train peak GiB")
    for r in steps:
        tps = r["rollout/response_len_mean"] * PROMPTS * N / r["perf/generate_s"]
        print(f"{r['step']} | {r['rollout/reward_mean']:.3f} | {r['train/loss']:.4f} | {r['train/grad_norm']:.4f} | "
              f"{r['rollout/logp_abs_diff']:.4f}/{r.get('rollout/logp_abs_diff_max', float('nan')):.4f} | "
              f"{r.get('rollout/sync_probe_logp_abs_diff', float('nan')):.4f} | {r['perf/weight_sync_s']:.3f} | "
              f"{tps:,.0f} | {r.get('perf/tokens_per_s', float('nan')):,.0f} | "
              f"{r.get('perf/gpu_rollout_used_gib', float('nan')):.2f} / "
              f"{r.get('perf/gpu_asleep_used_gib', float('nan')):.2f} | "
              f"{r.get('perf/gpu_train_peak_gib', float('nan')):.2f}")
    print(f"devices: {devices}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: the tiny model)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    try:
        import torch

        gpus = torch.cuda.device_count()
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpus else 0.0
    except Exception:  # noqa: BLE001 - no torch / broken driver: no GPU
        gpus = 0
    if gpus == 0:
        print("gpu-smoke: no CUDA GPU on this machine (torch.cuda.device_count() == 0); run it on a GPU machine. "
              "The CPU path is covered by `make test`.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-gpu-smoke-"))
    for sub in ("artifacts", "data", "params.yaml"):
        if (REPO / sub).exists():
            os.symlink(REPO / sub, workdir / sub)  # reuse (or build once) the tiny model
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    recipe = str(REPO / "recipes" / "grpo_gsm8k.py")
    posttrain = str(Path(sys.executable).with_name("posttrain"))  # the console script of this environment
    failures: list[str] = []
    try:
        for name, layout in layouts(gpus):
            print(f"\n== {name} ==")
            ovr = overrides(args, workdir / "gsm8k-smoke", workdir / "runs", f"gpu-smoke-{name}", layout)
            plan = subprocess.run([posttrain, "validate", recipe, "--", *ovr], cwd=workdir,
                                  env=env, capture_output=True, text=True, check=False)
            text = plan.stdout + plan.stderr
            print(text[text.find("preflight:"):] if "preflight:" in text else text)
            proc = subprocess.run([posttrain, "run", recipe, "--", *ovr], cwd=workdir,
                                  env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
                failures.append(f"{name}: the run did not finish")
                continue
            colocated = layout.get("cluster.placement", "colocated") == "colocated"
            model = Path(args.model).resolve() if args.model else workdir / "artifacts" / "tiny-model" / "warm"
            found = check_run(workdir / "runs" / f"gpu-smoke-{name}", args.steps, colocated, gpu_gib,
                              planned_asleep_gib(model))
            failures.extend(f"{name}: {f}" for f in found)
        print(f"\nlayouts: {[n for n, _ in layouts(gpus)]}; wall time {time.perf_counter() - started:.0f} s")
        for f in failures:
            print(f"gpu-smoke: FAILED: {f}", file=sys.stderr)
        if not failures:
            print("gpu-smoke: ok")
        return 1 if failures else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
