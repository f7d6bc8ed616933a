"""On-policy distillation (OPD): GRPO's topology plus a frozen teacher role (SPEC §6).

Each step runs `rollout -> reward -> annotate -> teacher -> distill -> validate -> train -> sync`,
then `evaluate` and `checkpoint` on cadence. The student (the policy workers, synced to the rollout
engine) samples; the teacher (`infra.teacher.TeacherWorker`, its own Ray actor, never synced) scores
the sampled tokens at the loss temperature; the scores travel as `batch.teacher_logp`, checked by the
gate; `distill` turns them into per-token advantages (`rl.distillation_mode=advantage`) or leaves
the batch for the direct reverse-KL loss. The annotations table keeps the task reward's group
advantage (logged, and a training signal only with `rl.opd_task_reward_weight > 0`).

    posttrain run recipes/opd_arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.grpo import Timer, _mean_over_ranks
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
from rl_core.config.loader import ConfigError
from tasks.annotate import annotate_task
from tasks.checkpoint import checkpoint_task, save_model_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import rollout_task, sync_task
from tasks.teacher import distill_task, teacher_task
from tasks.train import train_task
from tasks.validate import validate_task

logging.getLogger("prefect.task_runs").setLevel(os.environ.get("POSTTRAIN_TASK_LOG_LEVEL", "WARNING"))


def require_teacher(cfg: PosttrainConfig) -> None:
    """OPD needs `model.teacher`; refuse before any placement or model construction."""
    if cfg.job.algorithm != "opd":
        raise ConfigError([f"job.algorithm={cfg.job.algorithm!r}: the opd flow trains job.algorithm=opd only"])
    if not cfg.model.teacher:
        raise ConfigError([("model.teacher is not set: OPD distils a frozen teacher into the policy; set "
                            "model.teacher to a hub id or a model directory that shares the policy's tokenizer "
                            "(e.g. model.teacher=artifacts/tiny-model/teacher)")])


@flow(name="opd", log_prints=True)
def opd(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train an OPD recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    cfg = load_config(recipe, overrides)
    check(cfg)  # preflight: before any placement or model construction
    require_teacher(cfg)
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
    retry = dict(retries=cfg.job.task_retries, retry_delay_seconds=cfg.job.retry_delay_s)
    rollout = rollout_task.with_options(result_storage=(run_dir / "cache").resolve(), **retry)
    reward = reward_task.with_options(**retry)
    identity = importlib.import_module(BUILDERS[cfg.job.algorithm]).build_objective(
        cfg.rl, ObjectiveContext.from_config(cfg)).identity
    cfg_hash = config_hash(cfg)

    role = RolloutRole.build(cfg)
    step, version = plan.start_step, 0
    with RunTracker() as tracker, Cluster(cfg, recipe, overrides) as cluster, \
            TeacherRole(cfg, recipe, overrides) as teacher:
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
                t = time.perf_counter()
                scored = teacher_task(teacher, annotated.batch)
                timer.lap("teacher", t)
                t = time.perf_counter()
                annotated = distill_task(annotated, scored, cfg.rl)
                timer.lap("distill", t)
                t = time.perf_counter()
                validate_task(annotated, cfg.rollout.max_tokens, True)  # the table's advantage is the group's
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
