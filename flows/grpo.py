"""The GRPO-family flow: GRPO, Dr-GRPO, GSPO and legacy PG (they differ only in config).

Each step runs `rollout -> reward -> annotate -> validate -> train -> sync`, then `evaluate` and
`checkpoint` on cadence. The flow only orders phases; the work is in tasks, rl_core and infra.

    python -m flows.grpo --config recipes/arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.progress import RunProgress
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster import BUILDERS, Cluster
from infra.provenance import dvc_hashes
from infra.resume import checkpoint_meta, plan_resume, write_run_state
from infra.roles import RolloutRole
from infra.storage import CheckpointStore
from infra.teacher import TeacherRole
from infra.tracking import MetricsLog, RunTracker
from rl_core.algorithms.context import ObjectiveContext
from rl_core.config import PosttrainConfig, check, config_hash, load_config, write_resolved
from tasks.annotate import annotate_task
from tasks.checkpoint import checkpoint_task, save_model_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import rollout_task, sync_task
from tasks.teacher import distill_task, teacher_task
from tasks.train import train_task
from tasks.validate import validate_task

# Six task runs a step each log "Finished in state Completed()": noise that costs ~3 ms per task.
# Failures, retries and the flow's own lines still show; set POSTTRAIN_TASK_LOG_LEVEL=INFO to see all.
logging.getLogger("prefect.task_runs").setLevel(os.environ.get("POSTTRAIN_TASK_LOG_LEVEL", "WARNING"))

PUBLIC_PREFIXES = ("train/", "rollout/", "perf/", "val/")
# The annotations table's advantage is a group advantage (for OPD too: the teacher's per-token signal
# is a separate batch field, checked by the teacher task).
GROUP_RELATIVE = ("grpo", "dr_grpo", "gspo", "legacy_pg", "opd")
# trainer-side diagnostics that describe the rollout, published under rollout/*
ROLLOUT_KEYS = {"train/rollout_logp_abs_diff": "rollout/logp_abs_diff",
                "train/rollout_logp_abs_diff_max": "rollout/logp_abs_diff_max"}


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    merged = {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}
    return {ROLLOUT_KEYS.get(k, k): v for k, v in merged.items() if k.startswith(PUBLIC_PREFIXES)}


class Timer:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}

    def lap(self, name: str, started: float) -> None:
        self.laps[f"perf/{name}_s"] = time.perf_counter() - started


@flow(name="grpo", log_prints=True)
def grpo(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train a GRPO-family recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    cfg = load_config(recipe, overrides)
    check(cfg)  # preflight: before any placement or model construction
    return run_on_policy(cfg, recipe, overrides)


def run_on_policy(cfg: PosttrainConfig, recipe: str, overrides: list[str], *, with_teacher: bool = False) -> dict:
    """The on-policy step loop shared by the GRPO family and OPD (called inside their flows).

    `with_teacher` (OPD) adds a frozen teacher role and, after `annotate`, the `teacher` and
    `distill` phases; everything else — resume, tracking, cadence, checkpoints — is the same.
    """
    logger = get_run_logger()
    run_dir = Path(cfg.run_dir)
    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.tracking.keep_checkpoints,
                            remote_uri=cfg.tracking.checkpoint_uri)
    plan = plan_resume(cfg, store)
    config_path = write_resolved(cfg, run_dir)
    ensure_quickstart_artifacts(cfg, announce=logger.info)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    # steps after the checkpoint are redone; with no checkpoint every line is, step 0 included
    metrics_log.truncate_after(plan.start_step if plan.checkpoint is not None else -1)
    retry = {"retries": cfg.job.task_retries, "retry_delay_seconds": cfg.job.retry_delay_s}
    rollout = rollout_task.with_options(result_storage=(run_dir / "cache").resolve(), **retry)
    reward = reward_task.with_options(**retry)
    identity = importlib.import_module(BUILDERS[cfg.job.algorithm]).build_objective(
        cfg.rl, ObjectiveContext.from_config(cfg)).identity
    cfg_hash = config_hash(cfg)

    role = RolloutRole.build(cfg)
    step, version = plan.start_step, 0
    with RunTracker() as tracker, Cluster(cfg, recipe, overrides) as cluster, \
            (TeacherRole(cfg, recipe, overrides) if with_teacher else nullcontext()) as teacher:
        run_id = tracker.start(cfg, recipe=recipe, overrides=overrides, objective_identity=identity,
                               run_id=plan.run_state.get("mlflow_run_id"), prefect_flow_run_id=str(flow_run.id),
                               dvc_hashes=dvc_hashes(cfg), config_path=config_path,
                               resumed_from=str(plan.checkpoint) if plan.checkpoint else None)
        write_run_state(run_dir, {"mlflow_run_id": run_id, "config_hash": cfg_hash})
        if plan.checkpoint is not None:
            logger.info("resuming from %s (step %d)", plan.checkpoint, step)
            cluster.load_trainer_parts(plan.parts)
            role.sampler.load_state_dict(plan.parts["driver"]["sampler"])
            version = int(plan.parts["driver"]["policy_version"])
            role.engine.update_weights(plan.parts["trainer"]["model"], version)

        def log(record: dict) -> None:
            metrics_log.append(record)
            tracker.log_metrics(record, step=record["step"])
            bar.update(record)

        def evaluate() -> dict:
            return evaluate_task(role.engine, role.tokenizer, role.val, cfg.data, cfg.rollout.max_tokens)

        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate()})
            while step < cfg.rl.max_steps:
                step += 1
                timer, t_step = Timer(), time.perf_counter()
                rows = role.sampler.next_batch()
                t = time.perf_counter()
                role.engine.last_generate_s = 0.0  # stays 0 when the rollout comes from the cache
                completions = rollout(role.engine, role.prompts(rows), cfg.rollout.n, role.sampling(step),
                                      {"config": cfg_hash, "step": step, "version": version, "rows": rows})
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
                validate_task(annotated, cfg.rollout.max_tokens, cfg.job.algorithm in GROUP_RELATIVE)
                timer.lap("validate", t)
                t = time.perf_counter()
                per_rank = train_task(cluster, annotated.batch)
                timer.lap("train", t)
                t = time.perf_counter()
                version = sync_task(cluster, role.engine, version + 1)
                timer.lap("sync", t)
                step_s = time.perf_counter() - t_step
                record = {"step": step, "data/prompt_rows": rows, **_mean_over_ranks(per_rank), **annotated.stats,
                          **timer.laps, "perf/step_s": step_s, "perf/generate_s": role.engine.last_generate_s,
                          "perf/tokens_per_s": float(annotated.batch.loss_mask.sum()) / step_s,
                          "perf/policy_version": version}
                # orchestration overhead: step wall time not spent sampling or in forward/backward
                record["perf/overhead_s"] = step_s - record["perf/generate_s"] - max(
                    m["perf/train_compute_s"] for m in per_rank)
                every = cfg.rl.validation.every_steps
                if (every and step % every == 0) or step == cfg.rl.max_steps:
                    t = time.perf_counter()
                    record.update(evaluate())
                    timer.lap("evaluate", t)
                    record["perf/evaluate_s"] = timer.laps["perf/evaluate_s"]
                if (cfg.rl.save_every and step % cfg.rl.save_every == 0) or step == cfg.rl.max_steps:
                    t = time.perf_counter()
                    driver = {"sampler": role.sampler.state_dict(), "policy_version": version, "step": step}
                    checkpoint_task(store, cluster, step, driver, checkpoint_meta(cfg, mlflow_run_id=run_id))
                    record["perf/checkpoint_s"] = time.perf_counter() - t
                log(record)
        model_dir = save_model_task(cluster, run_dir / "final_model")
        tracker.log_curve(metrics_log.read(), run_dir / "curve.png")
        tracker.log_model_dir(model_dir)
    logger.info("run finished: %s (metrics: %s, MLflow run %s)", run_dir, metrics_log.path, run_id)
    return {"run_dir": str(run_dir), "metrics": str(metrics_log.path), "mlflow_run_id": run_id, "step": step}


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
