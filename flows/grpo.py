"""The GRPO-family flow: GRPO, Dr-GRPO, GSPO and legacy PG (they differ only in config).

Each step runs `rollout -> reward -> annotate -> validate -> train -> sync`, then `evaluate` and
`checkpoint` on cadence. The flow only orders phases; the work is in tasks, rl_core and infra.

    python -m flows.grpo --config recipes/arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextlib import nullcontext

from prefect import flow, get_run_logger

from flows.guard import check_run_parameters
from flows.progress import RunProgress
from flows.runner import Timer, TrainingRun, mean_over_ranks, run_with_restarts
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster import Cluster
from infra.roles import RolloutRole
from infra.teacher import TeacherRole
from infra.tracking import RunTracker
from rl_core.config import PosttrainConfig, check, load_config
from rl_core.config.environment import check_memory
from rl_core.registry import algorithm
from tasks.annotate import annotate_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import rollout_task, sync_task
from tasks.teacher import distill_task, teacher_task
from tasks.train import train_task
from tasks.validate import validate_task

# Six task runs a step each log "Finished in state Completed()": noise that costs ~3 ms per task.
# Failures, retries and the flow's own lines still show; set POSTTRAIN_TASK_LOG_LEVEL=INFO to see all.
logging.getLogger("prefect.task_runs").setLevel(os.environ.get("POSTTRAIN_TASK_LOG_LEVEL", "WARNING"))


@flow(name="grpo", log_prints=True)
def grpo(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train a GRPO-family recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    check_run_parameters(recipe, overrides)  # a deployment's parameters are untrusted input
    cfg = load_config(recipe, overrides)
    check(cfg)  # preflight: before any placement or model construction
    return run_with_restarts(cfg, lambda c: run_on_policy(c, recipe, overrides), get_run_logger().warning)


def run_on_policy(cfg: PosttrainConfig, recipe: str, overrides: list[str], *, with_teacher: bool = False) -> dict:
    """The on-policy step loop shared by the GRPO family and OPD (called inside their flows).

    `with_teacher` (OPD) adds a frozen teacher role and, after `annotate`, the `teacher` and
    `distill` phases; everything else — resume, tracking, cadence, checkpoints — is the same.
    """
    logger = get_run_logger()
    # inputs first: bad data or a plan that does not fit fails before the run directory is touched
    ensure_quickstart_artifacts(cfg, announce=logger.info)
    role = RolloutRole.build(cfg)
    check_memory(cfg, role.prompt_limit)  # the preflight plan again, with the data's real longest prompt
    run = TrainingRun.prepare(cfg, recipe, overrides, announce=logger.info)
    retry = {"retries": cfg.job.task_retries, "retry_delay_seconds": cfg.job.retry_delay_s}
    rollout = rollout_task.with_options(**retry)
    reward = reward_task.with_options(**retry)

    step = run.start_step
    with run, RunTracker() as tracker, Cluster(cfg, max_model_len=role.max_model_len) as cluster, \
            (TeacherRole(cfg) if with_teacher else nullcontext()) as teacher:
        run.start(tracker)
        engines = cluster.engines
        version = run.restore(cluster, role.sampler, logger.info)

        def log(record: dict) -> None:
            run.log(record, bar)

        def evaluate() -> dict:
            return evaluate_task.with_options(**retry)(engines, role.tokenizer, role.val, cfg.data,
                                                       cfg.rollout.max_tokens)

        run.finish_pending_evaluation(evaluate, logger.info)
        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate()})
            while step < cfg.rl.max_steps:
                step += 1
                timer, t_step = Timer(), time.perf_counter()
                rows = role.sampler.next_batch()
                t = time.perf_counter()
                engines.last_generate_s = 0.0  # stays 0 when the rollout comes from the cache
                completions = rollout(engines, role.prompts(rows), cfg.rollout.n, role.sampling(step),
                                      {"config": run.cfg_hash, "step": step, "version": version, "rows": rows},
                                      cache_dir=str((run.run_dir / "cache").resolve()))
                timer.lap("rollout", t)
                t = time.perf_counter()
                answers = [role.train[rows[i]].answer for i in completions.prompt_index.tolist()]
                rewards = reward(role.reward_fn, completions.decode_responses(role.tokenizer), answers)
                timer.lap("reward", t)
                t = time.perf_counter()
                annotated = annotate_task(completions, rewards, rows, cfg.rl, (step - 1) * len(rewards))
                timer.lap("annotate", t)
                if teacher is not None:
                    t = time.perf_counter()
                    scored = teacher_task(teacher, annotated.batch)
                    timer.lap("teacher", t)
                    t = time.perf_counter()
                    annotated = distill_task(annotated, scored, cfg.rl)
                    timer.lap("distill", t)
                t = time.perf_counter()
                validate_task(annotated, cfg.rollout.max_tokens, algorithm(cfg.job.algorithm).group_relative)
                timer.lap("validate", t)
                t = time.perf_counter()
                per_rank = train_task(cluster, annotated.batch)
                timer.lap("train", t)
                t = time.perf_counter()
                version += 1
                synced = sync_task(cluster, version)
                timer.lap("sync", t)
                step_s = time.perf_counter() - t_step
                record = {"step": step, "data/prompt_rows": rows, **mean_over_ranks(per_rank), **annotated.stats,
                          **timer.laps, **synced, "perf/step_s": step_s, "perf/generate_s": engines.last_generate_s,
                          "perf/tokens_per_s": float(annotated.batch.loss_mask.sum()) / step_s,
                          "perf/policy_version": version}
                # orchestration overhead: step wall time not spent sampling or in forward/backward
                record["perf/overhead_s"] = step_s - record["perf/generate_s"] - max(
                    m["perf/train_compute_s"] for m in per_rank)
                run.end_step(cluster, step, role.sampler, version, record, evaluate, bar)
        return run.finish(cluster, step, logger.info)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m flows.grpo")
    parser.add_argument("--config", required=True, help="recipes/<name>.py")
    args = parser.parse_args(own)
    from flows.entry import run_recipe

    run_recipe(args.config, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
