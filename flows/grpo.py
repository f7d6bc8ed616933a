"""The GRPO-family flow: GRPO, Dr-GRPO, GSPO and legacy PG (they differ only in config).

Each step runs `rollout -> reward -> annotate -> validate -> train -> sync`, then `evaluate` and
`checkpoint` on cadence. The flow only orders phases; the work is in tasks, rl_core and infra.

    python -m flows.grpo --config recipes/arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger

from flows.progress import RunProgress
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster import Cluster
from infra.roles import RolloutRole
from infra.tracking import MetricsLog
from rl_core.config import check, config_hash, load_config, write_resolved
from tasks.annotate import annotate_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import rollout_task, sync_task
from tasks.train import train_task
from tasks.validate import validate_task

PUBLIC_PREFIXES = ("train/", "rollout/", "perf/", "val/")


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    keys = per_rank[0].keys()
    return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in keys}


@flow(name="grpo", log_prints=True)
def grpo(recipe: str, overrides: list[str] | None = None) -> dict:
    """Train a GRPO-family recipe. Parameters are what a deployment passes: a recipe path and a dotlist."""
    overrides = list(overrides or [])
    cfg = load_config(recipe, overrides)
    check(cfg)  # preflight: before any placement or model construction
    logger = get_run_logger()
    run_dir = Path(cfg.run_dir)
    write_resolved(cfg, run_dir)
    ensure_quickstart_artifacts(cfg, announce=logger.info)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    results = run_dir / "cache"
    retry = dict(retries=cfg.job.task_retries, retry_delay_seconds=cfg.job.retry_delay_s)
    rollout = rollout_task.with_options(result_storage=results.resolve(), **retry)
    reward = reward_task.with_options(**retry)
    group_relative = cfg.job.algorithm in ("grpo", "dr_grpo", "gspo", "legacy_pg")

    role = RolloutRole.build(cfg)
    cfg_hash = config_hash(cfg)
    max_tokens = cfg.rollout.max_tokens
    start_step, version = 0, 0
    last: dict = {}
    with Cluster(cfg, recipe, overrides) as cluster, RunProgress(cfg.rl.max_steps, cfg.job.name, start_step) as bar:
        if cfg.rl.validation.before_training and start_step == 0:
            record = {"step": 0, **evaluate_task(role.engine, role.tokenizer, role.val, cfg.data, max_tokens)}
            metrics_log.append(record)
            bar.update(record)
        for step in range(start_step + 1, cfg.rl.max_steps + 1):
            t_step = time.perf_counter()
            rows = role.sampler.next_batch()
            sampling = role.sampling(step)
            t = time.perf_counter()
            completions = rollout(role.engine, role.prompts(rows), cfg.rollout.n, sampling,
                                  {"config": cfg_hash, "step": step, "version": version, "rows": rows})
            t_rollout = time.perf_counter() - t
            t = time.perf_counter()
            texts = completions.decode_responses(role.tokenizer)
            answers = [role.train[rows[i]].answer for i in completions.prompt_index.tolist()]
            rewards = reward(role.reward_fn, texts, answers)
            t_reward = time.perf_counter() - t
            t = time.perf_counter()
            annotated = annotate_task(completions, rewards, rows, cfg.rl, (step - 1) * len(rewards))
            t_annotate = time.perf_counter() - t
            t = time.perf_counter()
            validate_task(annotated, max_tokens, group_relative)
            t_validate = time.perf_counter() - t
            t = time.perf_counter()
            per_rank = train_task(cluster, annotated.batch)
            t_train = time.perf_counter() - t
            t = time.perf_counter()
            version = sync_task(cluster, role.engine, version + 1)
            t_sync = time.perf_counter() - t
            train_metrics = _mean_over_ranks(per_rank)
            tokens = float(annotated.batch.loss_mask.sum())
            step_s = time.perf_counter() - t_step
            record = {
                "step": step,
                **{k: v for k, v in train_metrics.items() if k.startswith(PUBLIC_PREFIXES)},
                **annotated.stats,
                "perf/rollout_s": t_rollout, "perf/reward_s": t_reward, "perf/annotate_s": t_annotate,
                "perf/validate_s": t_validate, "perf/train_s": t_train, "perf/sync_s": t_sync,
                "perf/step_s": step_s, "perf/tokens_per_s": tokens / max(step_s, 1e-9),
                "perf/policy_version": version,
            }
            every = cfg.rl.validation.every_steps
            if (every and step % every == 0) or step == cfg.rl.max_steps:
                t = time.perf_counter()
                record.update(evaluate_task(role.engine, role.tokenizer, role.val, cfg.data, max_tokens))
                record["perf/evaluate_s"] = time.perf_counter() - t
            metrics_log.append(record)
            bar.update(record)
            last = record
    logger.info("run finished: %s (metrics: %s)", run_dir, metrics_log.path)
    return {"run_dir": str(run_dir), "metrics": str(metrics_log.path), "last": last}


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
