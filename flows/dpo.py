"""Direct preference optimisation (DPO): offline pairs, no rollout and no reward (SPEC §6).

Before the loop the driver loads the pairs of `data.train` / `data.val` (JSONL or a hub dataset
`org/name[:split]`), refuses them with the failing pandera checks (`validate_preference_pairs`:
non-empty, chosen != rejected, responses within `rollout.max_tokens`), tensorises them
(`pairs_to_trajectory`) and scores the reference ONCE (`with_reference_logps`; the reference is
the frozen initial policy, or `rl.reference`). Each step then runs `select -> validate -> train`:
`rollout.prompts_per_step` pairs (pairs per step) from a seeded `PromptSampler` over the train
pairs, `batch.select(pair_rows(idx))`, the pair gate, and one train step on the data-parallel
workers (contiguous shards of whole pairs). On cadence: `sync` (rank 0's weights to the driver's
engine), `evaluate_pairs` (held-out `val/loss`, `val/reward_accuracy`, `val/margin`, ...) and
`evaluate` (greedy held-out accuracy on the val pairs' prompts against their chosen answers),
then `checkpoint` (trainer parts + the pair sampler's state: exact resume as GRPO).

    posttrain run recipes/dpo_arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path

import torch
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.grpo import Timer, _mean_over_ranks
from flows.progress import RunProgress
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster import BUILDERS, Cluster
from infra.provenance import dvc_hashes
from infra.resume import checkpoint_meta, plan_resume, write_run_state
from infra.storage import CheckpointStore
from infra.tracking import MetricsLog, RunTracker
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.dpo import with_reference_logps
from rl_core.config import PosttrainConfig, check, config_hash, load_config, write_resolved
from rl_core.config.loader import ConfigError
from rl_core.data import Example, PromptSampler
from rl_core.data.preferences import (
    load_preference_pairs,
    pair_rows,
    pairs_to_trajectory,
    validate_preference_pairs,
)
from rl_core.models import load_policy
from rl_core.rollout import make_engine
from tasks.checkpoint import checkpoint_task, save_model_task
from tasks.dpo import evaluate_pairs_task, validate_pairs_task
from tasks.evaluate import evaluate_task
from tasks.rollout import sync_task
from tasks.train import train_task

logging.getLogger("prefect.task_runs").setLevel(os.environ.get("POSTTRAIN_TASK_LOG_LEVEL", "WARNING"))

REFERENCE_CHUNK_ROWS = 256  # rows per reference forward when rl.micro_batch_per_replica is unset


def load_pairs(source: str, tokenizer, cfg: PosttrainConfig, key: str, limit: int | None = None):
    """Load, optionally truncate, and validate one pair split; the gate's error names the config key."""
    df = load_preference_pairs(source)
    if limit is not None:
        df = df.iloc[:limit].reset_index(drop=True)
    try:
        return validate_preference_pairs(df, tokenizer=tokenizer, max_response_tokens=cfg.rollout.max_tokens,
                                         task=cfg.data.task, template=cfg.data.prompt_template)
    except ValueError as exc:
        raise ValueError(f"{key}={source!r}: {exc}") from None


def accuracy_examples(df, task: str) -> list[Example]:
    """Held-out prompts with their chosen response as the reference answer (GSM8K: only where it has `#### N`)."""
    examples = [Example(str(p), str(c)) for p, c in zip(df["prompt"], df["chosen"])]
    if task == "gsm8k":
        from rl_core.rewards.gsm8k import extract_reference

        examples = [e for e in examples if extract_reference(e.answer) is not None]
    return examples


@flow(name="dpo", log_prints=True)
def dpo(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train a DPO recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    cfg = load_config(recipe, overrides)
    check(cfg)  # preflight: before any placement or model construction
    if cfg.job.algorithm != "dpo":
        raise ConfigError([f"job.algorithm={cfg.job.algorithm!r}: the dpo flow trains job.algorithm=dpo only"])
    logger = get_run_logger()
    run_dir = Path(cfg.run_dir)
    store = CheckpointStore(run_dir / "checkpoints", keep=cfg.tracking.keep_checkpoints,
                            remote_uri=cfg.tracking.checkpoint_uri)
    plan = plan_resume(cfg, store)
    config_path = write_resolved(cfg, run_dir)
    ensure_quickstart_artifacts(cfg, announce=logger.info)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    metrics_log.truncate_after(plan.start_step if plan.checkpoint is not None else -1)
    identity = importlib.import_module(BUILDERS[cfg.job.algorithm]).build_objective(
        cfg.rl, ObjectiveContext.from_config(cfg)).identity
    cfg_hash = config_hash(cfg)

    # -- the driver: policy (the frozen reference unless rl.reference names one), pairs, cached reference log-probs
    torch.manual_seed(cfg.job.seed)
    model, tokenizer = load_policy(cfg.model)
    model.eval()
    max_val = cfg.rl.validation.max_prompts
    train_df = load_pairs(cfg.data.train, tokenizer, cfg, "data.train")
    val_df = load_pairs(cfg.data.val, tokenizer, cfg, "data.val", limit=max_val)
    layout = {"task": cfg.data.task, "template": cfg.data.prompt_template}
    t = time.perf_counter()
    reference = model if cfg.rl.reference is None else load_policy(
        cfg.model.model_copy(update={"name_or_path": cfg.rl.reference}))[0]
    chunk = cfg.rl.micro_batch_per_replica or REFERENCE_CHUNK_ROWS
    train_pairs = with_reference_logps(reference, pairs_to_trajectory(train_df, tokenizer, **layout),
                                       temperature=cfg.rl.temperature, micro_batch_size=chunk)
    val_pairs = with_reference_logps(reference, pairs_to_trajectory(val_df, tokenizer, **layout),
                                     temperature=cfg.rl.temperature, micro_batch_size=chunk)
    del reference
    reference_s = time.perf_counter() - t
    logger.info("DPO: %d train pairs, %d held-out pairs; reference log-probs cached in %.1fs",
                len(train_df), len(val_df), reference_s)
    engine = make_engine(cfg.rollout, model, tokenizer, seed=cfg.sampling_seed, model_path=cfg.model.name_or_path,
                         dtype=cfg.model.dtype)
    val_examples = accuracy_examples(val_df, cfg.data.task)
    sampler = PromptSampler(len(train_df), cfg.rollout.prompts_per_step, seed=cfg.job.seed)

    step, version = plan.start_step, 0
    with RunTracker() as tracker, Cluster(cfg, recipe, overrides) as cluster:
        run_id = tracker.start(cfg, recipe=recipe, overrides=overrides, objective_identity=identity,
                               run_id=plan.run_state.get("mlflow_run_id"), prefect_flow_run_id=str(flow_run.id),
                               dvc_hashes=dvc_hashes(cfg), config_path=config_path,
                               resumed_from=str(plan.checkpoint) if plan.checkpoint else None)
        write_run_state(run_dir, {"mlflow_run_id": run_id, "config_hash": cfg_hash})
        if plan.checkpoint is not None:
            logger.info("resuming from %s (step %d)", plan.checkpoint, step)
            cluster.load_trainer_parts(plan.parts)
            sampler.load_state_dict(plan.parts["driver"]["sampler"])
            version = int(plan.parts["driver"]["policy_version"])
            engine.update_weights(plan.parts["trainer"]["model"], version)

        def log(record: dict) -> None:
            metrics_log.append(record)
            tracker.log_metrics(record, step=record["step"])
            bar.update(record)

        def evaluate() -> dict:
            out = evaluate_pairs_task(cluster, val_pairs)
            if val_examples:
                out.update(evaluate_task(engine, tokenizer, val_examples, cfg.data, cfg.rollout.max_tokens))
            return out

        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate(), "perf/reference_s": reference_s})
            while step < cfg.rl.max_steps:
                step += 1
                timer, t_step = Timer(), time.perf_counter()
                t = time.perf_counter()
                idx = sampler.next_batch()
                batch = train_pairs.select(pair_rows(idx))
                timer.lap("select", t)
                t = time.perf_counter()
                validate_pairs_task(batch, len(cluster.workers))
                timer.lap("validate", t)
                t = time.perf_counter()
                per_rank = train_task(cluster, batch)
                timer.lap("train", t)
                record = {"step": step, "data/pair_rows": idx, **_mean_over_ranks(per_rank), **timer.laps}
                every = cfg.rl.validation.every_steps
                if (every and step % every == 0) or step == cfg.rl.max_steps:
                    t = time.perf_counter()
                    version = sync_task(cluster, engine, step)
                    record["perf/sync_s"] = time.perf_counter() - t
                    t = time.perf_counter()
                    record.update(evaluate())
                    record["perf/evaluate_s"] = time.perf_counter() - t
                step_s = time.perf_counter() - t_step
                record.update({"perf/step_s": step_s,
                               "perf/tokens_per_s": float(batch.loss_mask.sum()) / step_s,
                               "perf/policy_version": version})
                if (cfg.rl.save_every and step % cfg.rl.save_every == 0) or step == cfg.rl.max_steps:
                    t = time.perf_counter()
                    driver = {"sampler": sampler.state_dict(), "policy_version": version, "step": step}
                    checkpoint_task(store, cluster, step, driver, checkpoint_meta(cfg, mlflow_run_id=run_id))
                    record["perf/checkpoint_s"] = time.perf_counter() - t
                log(record)
        model_dir = save_model_task(cluster, run_dir / "final_model")
        tracker.log_curve(metrics_log.read(), run_dir / "curve.png")
        tracker.log_model_dir(model_dir)
    logger.info("run finished: %s (metrics: %s, MLflow run %s)", run_dir, metrics_log.path, run_id)
    return {"run_dir": str(run_dir), "metrics": str(metrics_log.path), "mlflow_run_id": run_id, "step": step}
