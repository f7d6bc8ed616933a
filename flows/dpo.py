"""The offline flow: objectives trained on fixed preference pairs, with no rollout and no reward: DPO
(docs/objectives.md) and a reward model's Bradley–Terry training (`rl.objective.type=reward_model`, docs/rewards.md).

Before the loop the driver loads the pairs of `data.train` / `data.val` (JSONL or a hub dataset
`org/name[:split]`), refuses them with the failing pandera checks (`validate_preference_pairs`:
non-empty, chosen != rejected, responses within `rollout.max_tokens`), tensorises them
(`pairs_to_trajectory`); trainer rank 0 scores the reference ONCE (`with_reference_logps`; the
reference is the frozen initial policy, or `rl.reference`): the driver holds no weights. Each step then runs `select -> validate -> train`:
`rollout.prompts_per_step` pairs (pairs per step) from a seeded `PromptSampler` over the train
pairs, `batch.select(pair_rows(idx))`, the pair gate, and one train step on the data-parallel
workers (contiguous shards of whole pairs). On cadence: `sync` (rank 0's weights to the rollout
engines, which evaluate), `evaluate_pairs` (held-out `val/loss`, `val/reward_accuracy`, `val/margin`, ...) and
`evaluate` (greedy held-out accuracy on the val pairs' prompts against their chosen answers),
then `checkpoint` (trainer parts + the pair sampler's state: exact resume as GRPO).

A reward model is trained the same way without a reference, rollout engines or a sync: its held-out metrics are the
pairs' (`val/loss`, `val/accuracy`: the fraction of pairs it ranks right, `val/margin`), and its final model is an
`AutoModelForSequenceClassification`.

    posttrain run recipes/dpo_arithmetic.py -- rl.max_steps=50
    posttrain run recipes/rm_arithmetic.py
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from prefect import flow, get_run_logger

from flows.params import NO_KNOBS, RunKnobs, open_run
from flows.progress import RunProgress
from flows.restarts import run_with_restarts, worth_retrying
from flows.runner import Timer, TrainingRun, mean_over_ranks
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster.cluster import Cluster
from infra.tracking.tracker import RunTracker
from infra.workers.rewards import RewardPool
from rl_core.config import PosttrainConfig
from rl_core.config.explain import ConfigError
from rl_core.data import PromptSampler
from rl_core.data.preferences import (
    load_preference_pairs,
    pair_rows,
    pairs_to_trajectory,
    validate_preference_pairs,
)
from rl_core.model.loading import load_tokenizer
from rl_core.preflight.machine import check_memory
from rl_core.tasks import Example, get_task
from tasks.dpo import evaluate_pairs_task, validate_pairs_task
from tasks.evaluate import evaluate_task
from tasks.rollout import sync_task
from tasks.train import train_task

REFERENCE_CHUNK_ROWS = 256  # rows per reference forward when rl.micro_batch_per_replica is unset


def load_pairs(source: str, tokenizer, cfg: PosttrainConfig, key: str, limit: int | None = None):
    """Load, optionally truncate, and validate one pair split; the gate's error names the config key."""
    df = load_preference_pairs(source)
    if limit is not None:
        df = df.iloc[:limit].reset_index(drop=True)
    try:
        return validate_preference_pairs(df, tokenizer=tokenizer, max_response_tokens=cfg.rollout.max_tokens,
                                         task=cfg.data.task, template=cfg.data.prompt_template, data=cfg.data)
    except ValueError as exc:
        raise ValueError(f"{key}={source!r}: {exc}") from None


def accuracy_examples(df, task: str) -> list[Example]:
    """Held-out prompts with their chosen response as the reference answer, where the task's reward can judge
    it (GSM8K: a chosen response with `#### N`)."""
    examples = [Example(str(p), str(c)) for p, c in zip(df["prompt"], df["chosen"])]
    scorable = get_task(task).scorable
    return [e for e in examples if scorable(e)]


@flow(name="dpo", log_prints=True)
def dpo(recipe: str, overrides: list[str] | None = None, knobs: RunKnobs = NO_KNOBS) -> dict:
    """Train an offline recipe on preference pairs: DPO, or a reward model.

    Args:
        recipe: A recipe file under recipes/ (Python: its build_config() returns the config), or a finished run's
            config_resolved.yaml.
        overrides: Changes to the recipe, `key=value` each (e.g. rl.max_steps=20); from the API, the keys of
            flows/guard.py's allowlist only.
        knobs: The recipe knobs changed most often, typed; each one set is one more override.
    """
    overrides, cfg = open_run(recipe, overrides, knobs)  # guarded, checked (preflight), the run named job.name
    if cfg.rl.objective.topology != "offline":
        raise ConfigError([(f"rl.objective.type={cfg.rl.objective.type}: the dpo flow trains offline objectives only "
                           "(rl.objective.type=dpo, reward_model)")])
    return run_with_restarts(cfg, lambda c: train_dpo(c, recipe, overrides), get_run_logger().warning)


def train_dpo(cfg: PosttrainConfig, recipe: str, overrides: list[str]) -> dict:
    """The offline run proper, inside the flow (started again by `run_with_restarts` when a Ray actor dies)."""
    logger = get_run_logger()
    ensure_quickstart_artifacts(cfg, announce=logger.info)

    # -- inputs first (bad pairs fail before the run directory is touched). The driver holds the tokenizer
    # -- and pairs only (no weights); the reference is scored ONCE, on trainer rank 0
    tokenizer = load_tokenizer(cfg.model)
    max_val = cfg.rl.validation.max_prompts
    train_df = load_pairs(cfg.data.train, tokenizer, cfg, "data.train")
    val_df = load_pairs(cfg.data.val, tokenizer, cfg, "data.val", limit=max_val)
    layout = {"task": cfg.data.task, "template": cfg.data.prompt_template, "data": cfg.data}
    train_pairs = pairs_to_trajectory(train_df, tokenizer, **layout)
    val_pairs = pairs_to_trajectory(val_df, tokenizer, **layout)
    val_examples = accuracy_examples(val_df, cfg.data.task)
    sampler = PromptSampler(len(train_df), cfg.rollout.prompts_per_step, seed=cfg.job.seed)
    max_model_len = max(int(train_pairs.attention_mask.shape[1]), int(val_pairs.attention_mask.shape[1])) \
        + cfg.rollout.max_tokens
    # the preflight plan again, with the data's real lengths: its sequence (prompt + max_tokens) = the widest pair
    check_memory(cfg, max(max_model_len - 2 * cfg.rollout.max_tokens, 1))
    run = TrainingRun.prepare(cfg, recipe, overrides, announce=logger.info)
    retry = {"retries": cfg.job.task_retries, "retry_delay_seconds": cfg.job.retry_delay_s,
             "retry_condition_fn": worth_retrying}
    samples = cfg.rl.objective.trains_policy  # a reward model: no engines to evaluate or sync, no reward functions

    step = run.start_step
    with run, RunTracker() as tracker, Cluster(cfg, max_model_len=max_model_len, with_engines=samples) as cluster, \
            run.checkpoints_of(cluster), (RewardPool(cfg, cluster.placement) if samples else nullcontext()) as rewards:
        t = time.perf_counter()
        if cfg.rl.objective.reads_reference:
            chunk = cfg.rl.micro_batch_per_replica or REFERENCE_CHUNK_ROWS
            train_pairs = train_pairs.replace(ref_logp=cluster.reference_logps(train_pairs, chunk))
            val_pairs = val_pairs.replace(ref_logp=cluster.reference_logps(val_pairs, chunk))
        reference_s = time.perf_counter() - t
        logger.info("%s: %d train pairs, %d held-out pairs%s", cfg.rl.objective.type, len(train_df), len(val_df),
                    f"; reference log-probs cached in {reference_s:.1f}s" if cfg.rl.objective.reads_reference else "")
        run.start(tracker, train=train_df, val=val_df)
        version = run.restore(cluster, sampler, logger.info)

        def log(record: dict) -> None:
            run.log(record, bar)

        def evaluate() -> dict:
            out = evaluate_pairs_task.with_options(**retry)(cluster, val_pairs, step=step)  # the step being evaluated
            if val_examples and samples:
                out.update(evaluate_task.with_options(**retry)(cluster.engines, tokenizer, val_examples, cfg.data,
                                                               cfg.rollout.max_tokens, rewards, step=step))
            return out

        run.finish_pending_evaluation(evaluate, logger.info)
        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate(), "perf/reference_s": reference_s})
            while step < cfg.rl.max_steps:
                step += 1
                timer = Timer()
                with timer.phase("select"):
                    idx = sampler.next_batch()
                    batch = train_pairs.select(pair_rows(idx))
                with timer.phase("validate"):
                    validate_pairs_task(batch, len(cluster.workers), cfg.rl.objective.reads_reference, step=step)
                with timer.phase("train"):
                    per_rank = train_task(cluster, batch, step=step)
                if samples and run.due(cfg.rl.validation.every_steps, step):  # the engines evaluate: to this step
                    with timer.phase("sync"):
                        version = step
                        synced = sync_task(cluster, version, step=step)
                else:
                    synced = {}
                    version = version if samples else step  # a reward model: no engines to hold an older one
                record = {"step": step, "data/pair_rows": idx, **mean_over_ranks(per_rank), **timer.laps, **synced}
                step_s = timer.elapsed()
                record.update({"perf/step_s": step_s,
                               "perf/tokens_per_s": float(batch.loss_mask.sum()) / step_s,
                               "perf/policy_version": version})
                run.end_step(cluster, step, sampler.state_dict(), version, record, evaluate, bar)
        return run.finish(cluster, step, logger.info)
