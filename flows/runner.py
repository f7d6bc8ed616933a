"""What every training flow does around its own step loop (GRPO family, OPD, DPO).

Before the loop (`TrainingRun.prepare`): the checkpoint store and resume plan (a changed math key
is refused here), the resolved config, missing quickstart artifacts, the metrics log cut back to
the checkpoint (or restored from it: every checkpoint carries the metrics.jsonl lines up to its
step, so a resume on a machine without the run directory, from S3, keeps the whole history), the
objective identity and config hash. Inside the Ray cluster: `start` (the MLflow
run, continued on resume, its dataset inputs, and `run_state.json`), `restore` (trainer parts, the sampler, the policy
version, then a checked weight sync to the rollout engines), `log` (metrics.jsonl + MLflow + progress), `due`
(cadence), `checkpoint` (asynchronous: the ranks write their shards while the next step runs; `settle` publishes
it, and the metrics lines of the steps since are held back until then, so a metrics line on disk always has its
checkpoint behind it), `sample` (completions with their rewards to MLflow, on cadence), and `finish` (final
model, curve, the model as an MLflow LoggedModel, the run's MLflow UI address, the flow's return value).
The flows keep only the phases of a step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from prefect.runtime import flow_run

from flows.artifacts import RunArtifacts
from infra.checkpoints.lease import S3Lease
from infra.checkpoints.resume import (
    ResumePlan,
    RunLock,
    checkpoint_meta,
    checkpoint_prefix,
    plan_resume,
    read_run_state,
    record_run,
    run_identity,
    write_run_state,
)
from infra.checkpoints.store import FINAL_MODEL, CheckpointError, CheckpointStore
from infra.tracking.plots import curve_title
from infra.tracking.provenance import dvc_hashes
from infra.tracking.tracker import MetricsLog, RunTracker, ui_command
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.registry import build_objective
from rl_core.config import PosttrainConfig, config_hash, write_resolved
from rl_core.rewards import success_reward
from rl_core.rewards.configured import reward_names
from tasks.checkpoint import commit_checkpoint_task, save_model_task, start_checkpoint_task
from tasks.rollout import prune_rollout_cache

PUBLIC_PREFIXES = ("train/", "critic/", "rollout/", "perf/", "val/")  # critic/: PPO's value model
# trainer-side diagnostics that describe the rollout, published under rollout/*
ROLLOUT_KEYS = {"train/rollout_logp_abs_diff": "rollout/logp_abs_diff",
                "train/rollout_logp_abs_diff_max": "rollout/logp_abs_diff_max"}


METRICS_PART = "metrics_jsonl"  # key of the driver part that carries metrics.jsonl up to the checkpoint's step


# Six task runs a step each log "Finished in state Completed()": noise, at a cost per task.
# Failures, retries and the flow's own lines still show; set POSTTRAIN_TASK_LOG_LEVEL=INFO to see all.
logging.getLogger("prefect.task_runs").setLevel(os.environ.get("POSTTRAIN_TASK_LOG_LEVEL", "WARNING"))


def restore_metrics(metrics_log: MetricsLog, saved_text: str | None) -> list[int]:
    """Fill the metrics log from a checkpoint's copy when the log lacks steps the copy has; the steps restored.

    A log that already holds every saved step (the same machine, cut back to the checkpoint) is kept
    as it is; otherwise (a fresh machine, a lost or damaged file) the checkpoint's lines replace it.
    """
    if not saved_text:
        return []
    saved = [json.loads(line) for line in saved_text.splitlines() if line.strip()]
    have = {r.get("step") for r in metrics_log.read()}
    missing = sorted({r["step"] for r in saved} - have)
    if not missing:
        return []
    metrics_log.replace(saved)
    return missing


class Timer:
    """Wall time of a step's phases: `with timer.phase("rollout"): ...` adds to `perf/rollout_s` in `laps` (a phase
    that runs several times in a step, as dynamic sampling's rounds do, counts them all)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            key = f"perf/{name}_s"
            self.laps[key] = self.laps.get(key, 0.0) + time.perf_counter() - t

    def elapsed(self) -> float:
        """Seconds since the timer was made (the step's wall time so far)."""
        return time.perf_counter() - self.started


def mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' public metrics averaged (the ranks hold identical weights; their shards differ); GPU memory
    (`perf/gpu_*`) is the largest rank's."""
    merged = {k: max(m[k] for m in per_rank) if k.startswith("perf/gpu_") else sum(m[k] for m in per_rank) / len(per_rank)
              for k in per_rank[0]}
    return {ROLLOUT_KEYS.get(k, k): v for k, v in merged.items() if k.startswith(PUBLIC_PREFIXES)}


def due(every: int, step: int, last: int) -> bool:
    """The evaluation and checkpoint cadence: every `every` steps (0: never) and always at step `last`."""
    return bool(every and step % every == 0) or step == last


@dataclass
class TrainingRun:
    cfg: PosttrainConfig
    recipe: str
    overrides: list[str]
    run_dir: Path
    store: CheckpointStore
    plan: ResumePlan
    config_path: Path
    metrics_log: MetricsLog
    identity: dict[str, Any]
    cfg_hash: str
    tracker: RunTracker | None = None
    run_id: str | None = None
    lock: RunLock | None = None
    evaluation_pending: bool = False  # the checkpoint's step was due for an evaluation (restore sets it)
    # rl.async_steps: the prompt rows of the steps that were in flight at the checkpoint (restore sets them), drawn
    # again in that order before the sampler's next
    in_flight_rows: list[list[int]] = field(default_factory=list)
    saving: tuple[int, Path, dict] | None = None  # the checkpoint in flight: (step, temporary directory, meta)
    held: list[dict] = field(default_factory=list)  # metrics lines waiting for it
    artifacts: RunArtifacts | None = None  # the flow run's Prefect artifacts (flows/artifacts.py), from `start`

    @classmethod
    def prepare(cls, cfg: PosttrainConfig, recipe: str, overrides: list[str],
                announce: Callable[[str], None]) -> TrainingRun:
        """Lock the run directory, lease its S3 prefix (`infra.checkpoints.lease`), plan the resume, write the resolved config;
        use the result as a context manager (`with run, ...:`), whose exit releases the lease and the lock."""
        lock = RunLock(cfg).acquire()  # before anything in the run directory is read, deleted or written
        try:
            return cls._prepare(cfg, recipe, overrides, announce, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _prepare(cls, cfg: PosttrainConfig, recipe: str, overrides: list[str], announce: Callable[[str], None],
                 lock: RunLock) -> TrainingRun:
        run_dir = Path(cfg.run_dir)
        run_id = run_identity(cfg)  # its own S3 prefix: another run's steps are never listed, loaded or pruned
        # uploads in the background: training goes on while S3 is slow or briefly down (`finish` waits for them)
        store = CheckpointStore(run_dir / "checkpoints", keep=cfg.tracking.keep_checkpoints,
                                remote_uri=checkpoint_prefix(cfg, run_id), s3_config=cfg.tracking.s3,
                                background_upload=True)
        if store.bucket is not None:
            # one writer per S3 prefix: another host (or container) with this run directory's path may have
            # adopted the same run id; before anything on S3 is read for the plan, deleted or written
            store.lease = S3Lease(store, str(run_dir.resolve())).acquire(lock.previous)
            lock.note(f"lease {store.lease.owner}")
        try:
            return cls._plan(cfg, recipe, overrides, announce, lock, run_dir, run_id, store)
        except BaseException:
            if store.lease is not None:
                store.lease.release()
            raise

    @classmethod
    def _plan(cls, cfg: PosttrainConfig, recipe: str, overrides: list[str], announce: Callable[[str], None],
              lock: RunLock, run_dir: Path, run_id: str, store: CheckpointStore) -> TrainingRun:
        plan = plan_resume(cfg, store)
        record_run(cfg, store, run_id)
        config_path = write_resolved(cfg, run_dir)
        metrics_log = MetricsLog(run_dir / "metrics.jsonl")
        # steps after the checkpoint are redone; with no checkpoint every line is, step 0 included
        metrics_log.truncate_after(plan.start_step if plan.checkpoint is not None else -1)
        if plan.checkpoint is not None:
            restored = restore_metrics(metrics_log, plan.parts.get("driver", {}).get(METRICS_PART))
            if restored:
                announce(f"metrics.jsonl: steps {restored[0]}..{restored[-1]} restored from {plan.checkpoint}")
        identity = build_objective(cfg, ObjectiveContext.from_config(cfg)).identity
        return cls(cfg, recipe, list(overrides), run_dir, store, plan, config_path, metrics_log, identity,
                   config_hash(cfg), lock=lock)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            # a failed run still finishes its last upload, so a restart or a resume elsewhere finds it on S3
            self.store.flush()
        except CheckpointError as error:
            if exc[0] is None:
                raise
            logging.getLogger("posttrain").warning("%s", error)
        finally:
            if self.store.lease is not None:  # after the last upload: the prefix is free for the next run
                self.store.lease.release()
            if self.lock is not None:
                self.lock.release()

    @property
    def start_step(self) -> int:
        return self.plan.start_step

    def start(self, tracker: RunTracker, *, train: Any, val: Any) -> str:
        """Open (or, on resume, continue) the MLflow run, log the `train`/`val` splits (Examples or a DataFrame) as
        its dataset inputs, and record it in `run_state.json`."""
        self.tracker = tracker
        self.run_id = tracker.start(
            self.cfg, recipe=self.recipe, overrides=self.overrides, objective_identity=self.identity,
            run_id=self.plan.run_state.get("mlflow_run_id"), prefect_flow_run_id=str(flow_run.id),
            dvc_hashes=dvc_hashes(self.cfg), config_path=self.config_path,
            resumed_from=str(self.plan.checkpoint) if self.plan.checkpoint else None)
        tracker.log_datasets(self.cfg, train=train, val=val)
        write_run_state(self.run_dir, {**read_run_state(self.run_dir), "mlflow_run_id": self.run_id,
                                       "config_hash": self.cfg_hash})
        self.artifacts = RunArtifacts(self.cfg.job.name, self.cfg.rl.max_steps)
        self.artifacts.start(tracker.server_url, self.run_id, self.start_step)
        return self.run_id

    def record_placement(self, cluster: Any, teachers: Any = None, rewards: Any = None) -> dict:
        """Write `placement.json`: the node, IP, pid and device of every trainer rank and rollout engine, of every
        OPD teacher replica (`teachers`: the teacher role) and reward-model replica (`rewards`: the reward pool)."""
        where = cluster.node_map()
        if teachers is not None:
            where["teachers"] = teachers.node_map()
        where.update({"reward_models": models} if rewards is not None and (models := rewards.node_map()) else {})
        (self.run_dir / "placement.json").write_text(json.dumps(where, indent=1) + "\n")
        return where

    def restore(self, cluster: Any, sampler: Any, announce: Callable[..., None], teachers: Any = None,
                rewards: Any = None) -> int:
        """Load the checkpoint (if any) into the workers and the sampler, then bring the rollout engines to the
        trainers' weights (a checked sync, also on a fresh start); the policy version. Records the placement
        (`teachers`: the OPD teacher role, `rewards`: the reward pool, recorded with it)."""
        version = 0
        if self.plan.checkpoint is not None:
            announce("resuming from %s (step %d)", self.plan.checkpoint, self.start_step)
            parts = self.plan.parts
            cluster.load_checkpoint(self.plan.checkpoint, parts)
            sampler.load_state_dict(parts["driver"]["sampler"])
            version = int(parts["driver"]["policy_version"])
            self.evaluation_pending = bool(parts["driver"].get("evaluation_due", False))
            self.in_flight_rows = [[int(i) for i in rows] for rows in parts["driver"].get("in_flight_rows", [])]
            self.plan.parts = {}  # the trainers hold the weights now; the driver keeps none
        self.record_placement(cluster, teachers, rewards)
        cluster.sync_weights(version)
        return version

    def log(self, record: dict, bar: Any) -> None:
        """The progress display now; metrics.jsonl and MLflow once the checkpoint in flight (if any) is published."""
        bar.update(record)
        if self.artifacts is not None:
            self.artifacts.step(record["step"])
        if self.saving is not None:
            self.held.append(record)
            return
        self.metrics_log.append(record)
        self.tracker.log_metrics(record, step=record["step"])

    def sample(self, step: int, examples: list, texts: list[str], rewards: list, finish_reasons: list[str],
               reward_values: dict[str, list] | None = None, completions: Any = None) -> None:
        """Every `tracking.sample_completions_every` steps (and at the last): some of the step's completions with
        their rewards (`reward_values`: each function's own, by name) to the MLflow run's completions table, and to
        the flow run's completions artifact. Every step: `tracking.trace_episodes` of an agent task's episodes
        (`completions.episodes`) as MLflow traces."""
        traced = self.cfg.tracking.trace_episodes
        if traced and completions is not None and completions.episodes is not None:
            self.tracker.log_episode_traces(step, completions.episodes, rewards, count=traced,
                                            policy_version=int(completions.policy_version))
        every = self.cfg.tracking.sample_completions_every
        if every and self.due(every, step):  # 0: never, not even at the last step
            frame = self.tracker.log_completions(step, examples, texts, rewards,
                                                 count=self.cfg.tracking.sample_completions, finish_reasons=finish_reasons,
                                                 reward_values=reward_values)
            if self.artifacts is not None:
                self.artifacts.completions(step, frame.to_dict("records"))

    def settle(self, cluster: Any, wait: bool = True) -> None:
        """Publish the checkpoint in flight once every rank's shards are on disk (`wait`: block until then), then write
        the metrics lines held back for it."""
        if self.saving is None:
            return
        written = cluster.checkpoint_written(wait)
        if written is None:
            return
        step, tmp, meta = self.saving
        self.saving = None
        commit_checkpoint_task(self.store, tmp, step, meta, written)
        prune_rollout_cache(self.run_dir / "cache", step)  # a resume starts after this step: its rollouts are done
        for record in self.held:
            self.metrics_log.append(record)
            self.tracker.log_metrics(record, step=record["step"])
        self.held = []

    @contextmanager
    def checkpoints_of(self, cluster: Any) -> Iterator[None]:
        """Around a flow's steps, inside the cluster: however they end (a failed task, an evaluation that failed after
        its retries), the checkpoint in flight is published before the cluster goes, when its shards were written."""
        try:
            yield
        finally:
            try:
                self.settle(cluster)
            except Exception as error:  # noqa: BLE001 - a dead rank: the checkpoint stays unpublished, the error above
                logging.getLogger("posttrain").warning("the checkpoint of step %s was not published: %s",
                                                       self.saving[0] if self.saving else "?", error)
                self.saving = None

    def due(self, every: int, step: int) -> bool:
        """Cadence: every `every` steps (0: never) and always at the last step."""
        return due(every, step, self.cfg.rl.max_steps)

    def end_step(self, cluster: Any, step: int, sampler_state: dict, version: int, record: dict,
                 evaluate: Callable[[], dict], bar: Any, in_flight: list[list[int]] = ()) -> None:
        """The end of a step, in this order: the checkpoint (when due), the evaluation (when due), the metrics line.

        The checkpoint comes first so that an evaluation that fails (after its task retries) or is killed
        never costs the step's training; a run resumed from that checkpoint finishes the evaluation it was
        waiting for (`finish_pending_evaluation`).
        """
        self.settle(cluster, wait=False)
        evaluating = self.due(self.cfg.rl.validation.every_steps, step)
        if self.due(self.cfg.rl.save_every, step):
            record["perf/checkpoint_s"] = self.checkpoint(cluster, step, sampler_state, version, record,
                                                          evaluation_due=evaluating, in_flight=in_flight)
        if evaluating:
            timer = Timer()
            with timer.phase("evaluate"):
                record.update(evaluate())
            record.update(timer.laps)
        self.log(record, bar)

    def finish_pending_evaluation(self, evaluate: Callable[[], dict], announce: Callable[..., None]) -> None:
        """After `restore`: when the checkpoint's step was due for evaluation and its metrics line has none (the
        run stopped during it), evaluate now (the engines hold exactly that step's weights) and complete the line."""
        if not self.evaluation_pending:
            return
        self.evaluation_pending = False
        records = self.metrics_log.read()
        if not records or records[-1].get("step") != self.start_step or any(k.startswith("val/") for k in records[-1]):
            return
        announce("step %d was checkpointed but its evaluation did not finish; evaluating it now", self.start_step)
        timer = Timer()
        with timer.phase("evaluate"):
            records[-1].update(evaluate())
        records[-1].update(timer.laps)
        self.metrics_log.replace(records)
        self.tracker.log_metrics(records[-1], step=self.start_step)

    def checkpoint(self, cluster: Any, step: int, sampler_state: dict, version: int, record: dict, *,
                   evaluation_due: bool = False, in_flight: list[list[int]] = ()) -> float:
        """Start the checkpoint of `step`: the trainer ranks' shards (written in the background) and the driver's state
        (`sampler_state`: the sampler at the end of this step, after every draw so far; `in_flight`: the prompt rows
        of the later steps already drawn, in step order (rl.async_steps); the policy version; the metrics.jsonl lines up to this step: those logged and `record`, this
        step's, still to be logged; whether the step's evaluation is still to run). At most one is in flight: the
        previous one is published first. Returns the seconds the step was blocked."""
        t = time.perf_counter()
        self.settle(cluster)
        driver = {"sampler": sampler_state, "in_flight_rows": [list(rows) for rows in in_flight],
                  "policy_version": version, "step": step,
                  "evaluation_due": evaluation_due,
                  METRICS_PART: self.metrics_log.text() + MetricsLog.line(record) + "\n"}
        tmp = start_checkpoint_task(self.store, cluster, step, driver)
        self.saving = (step, tmp, checkpoint_meta(self.cfg, mlflow_run_id=self.run_id))
        return time.perf_counter() - t

    def finish(self, cluster: Any, step: int, announce: Callable[..., None]) -> dict:
        """Save the final model, log the curve and the model (a LoggedModel) to MLflow, say where the run is in the
        MLflow UI; the flow's return value."""
        self.settle(cluster)
        model_dir = save_model_task(cluster, self.run_dir / FINAL_MODEL, self.store)
        self.store.flush()  # every checkpoint is on S3 (or the failure is raised) before the run reports done
        self.tracker.log_curve(self.metrics_log.read(), self.run_dir / "curve.png",
                               curve_title(self.cfg.job.name, self.cfg.rl.objective.type))
        self.tracker.log_model(model_dir, self.cfg, step)
        url, ui = self.tracker.url, ui_command(self.tracker.tracking_uri)
        announce("run finished: %s (metrics: %s)", self.run_dir, self.metrics_log.path)
        announce("MLflow run: %s%s", url, f" (serve the store with: {ui})" if ui else "")
        decider = success_reward(self.cfg.data.success_reward, reward_names(self.cfg.data)) \
            if self.cfg.rl.objective.trains_policy else None  # what val/accuracy counts (a reward model's: pairs)
        if self.artifacts is not None:
            valid = self.store.list_valid()
            self.artifacts.summary(self.metrics_log.read(), step=step, run_dir=self.run_dir,
                                   checkpoint=valid[-1] if valid else None, model_dir=model_dir,
                                   mlflow_run_id=self.run_id, tracking_uri=self.tracker.tracking_uri,
                                   success_reward=decider)
        return {"run_dir": str(self.run_dir), "metrics": str(self.metrics_log.path), "mlflow_run_id": self.run_id,
                "mlflow_url": url, "step": step, "success_reward": decider}
