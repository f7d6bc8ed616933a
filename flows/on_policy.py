"""The on-policy step loop, shared by the GRPO-family flow and the OPD flow (the `on_policy` and `teacher`
topologies of rl_core.registry).

Each step runs `rollout -> reward -> annotate [-> teacher -> distill] -> validate -> train -> sync`, then the
checkpoint and the evaluation on cadence (`TrainingRun.end_step`). It only orders phases; the work is in
tasks, rl_core and infra.
"""

from __future__ import annotations

from contextlib import nullcontext

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from flows.progress import RunProgress
from flows.runner import Timer, TrainingRun, mean_over_ranks
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster import Cluster
from infra.roles import RolloutRole
from infra.teacher import TeacherRole
from infra.tracking import RunTracker
from rl_core.config import PosttrainConfig
from rl_core.config.environment import check_memory
from rl_core.registry import algorithm
from tasks.annotate import annotate_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import rollout_task, sync_task
from tasks.teacher import distill_task, teacher_task
from tasks.train import train_task
from tasks.validate import validate_task


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

    group_relative = algorithm(cfg.job.algorithm).group_relative  # the gate checks groups (rl_core.registry)
    step = run.start_step
    with run, RunTracker() as tracker, Cluster(cfg, max_model_len=role.max_model_len) as cluster, \
            (TeacherRole(cfg) if with_teacher else nullcontext()) as teacher:
        run.start(tracker)
        engines = cluster.engines
        version = run.restore(cluster, role.sampler, logger.info)

        def log(record: dict) -> None:
            run.log(record, bar)

        def evaluate() -> dict:
            return evaluate_task.with_options(**retry)(quote(engines), quote(role.tokenizer), quote(role.val),
                                                       quote(cfg.data), cfg.rollout.max_tokens)

        run.finish_pending_evaluation(evaluate, logger.info)
        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate()})
            while step < cfg.rl.max_steps:
                step += 1
                timer = Timer()
                rows = role.sampler.next_batch()
                engines.last_generate_s = 0.0  # stays 0 when the rollout comes from the cache
                with timer.phase("rollout"):
                    completions = rollout(quote(engines), quote(role.prompts(rows)), cfg.rollout.n,
                                          quote(role.sampling(step)),
                                          quote({"config": run.cfg_hash, "step": step, "version": version, "rows": rows}),
                                          cache_dir=str((run.run_dir / "cache").resolve()))
                with timer.phase("reward"):
                    answers = [role.train[rows[i]].answer for i in completions.prompt_index.tolist()]
                    rewards = reward(quote(role.reward_fn), quote(completions.decode_responses(role.tokenizer)),
                                     quote(answers))
                with timer.phase("annotate"):
                    annotated = annotate_task(quote(completions), quote(rewards), quote(rows), quote(cfg.rl),
                                              (step - 1) * len(rewards))
                if teacher is not None:
                    with timer.phase("teacher"):
                        scored = teacher_task(quote(teacher), quote(annotated.batch))
                    with timer.phase("distill"):
                        annotated = distill_task(quote(annotated), quote(scored), quote(cfg.rl))
                with timer.phase("validate"):
                    validate_task(quote(annotated), cfg.rollout.max_tokens, group_relative)
                with timer.phase("train"):
                    per_rank = train_task(quote(cluster), quote(annotated.batch))
                with timer.phase("sync"):
                    version += 1
                    synced = sync_task(quote(cluster), version)
                step_s = timer.elapsed()
                record = {"step": step, "data/prompt_rows": rows, **mean_over_ranks(per_rank), **annotated.stats,
                          **timer.laps, **synced, "perf/step_s": step_s, "perf/generate_s": engines.last_generate_s,
                          "perf/tokens_per_s": float(annotated.batch.loss_mask.sum()) / step_s,
                          "perf/policy_version": version}
                # orchestration overhead: step wall time not spent sampling or in forward/backward
                record["perf/overhead_s"] = step_s - record["perf/generate_s"] - max(
                    m["perf/train_compute_s"] for m in per_rank)
                run.end_step(cluster, step, role.sampler, version, record, evaluate, bar)
        return run.finish(cluster, step, logger.info)
