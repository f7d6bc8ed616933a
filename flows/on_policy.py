"""The on-policy step loop, shared by the GRPO-family flow and the OPD flow (the `on_policy` and `teacher`
topologies of rl_core.algorithms.registry).

Each step runs `rollout (an agent task: episodes) -> reward -> annotate [-> teacher -> distill | -> values] -> validate -> train
-> sync` (the teacher with OPD, the critic's values with PPO), then the
checkpoint and the evaluation on cadence (`TrainingRun.end_step`). It only orders phases; the work is in
tasks, rl_core and infra.

With `rl.async_steps=k` up to k later steps' rollouts are in flight (Prefect task futures, in threads) while
a step trains: the draw of step s+k is submitted as step s begins, with the engines on policy version s-1,
so its batch reaches the trainer k versions behind it. The engines take the calls in submission order, so a
sync waits for the rollouts submitted before it. The gate bounds every batch's version to
[trainer version - rl.async_steps, trainer version], and the trainer takes π_old of a stale batch from its
rollout log-probs. A step's checkpoint keeps the sampler's state at the step's end and the prompt rows of the
steps in flight: a run resumed from it draws those steps' rows again, in order (their rollouts with the restored
weights), then the sampler's next, so no prompt is skipped or trained twice.

With `rollout.filter_groups` (dynamic sampling) a step's rollout and reward run in rounds: groups whose rewards do
not spread are dropped and further rounds draw the sampler's next prompts, each with its own seed (the step's and
the round), until the step has `rollout.prompts_per_step` useful groups or the rounds run out
(`rl_core.batch.dynamic_sampling` chooses; `docs/rollout.md`). The sampler observes every round's pass rates
(the curriculum's feedback; the epoch order ignores it). With rl.async_steps the extra rounds of step s draw after
the steps in flight (they sample with the engines' current weights) and the curriculum draws a step by the pass
rates of the steps scored before its draw.
"""

from __future__ import annotations

from collections import deque
from contextlib import ExitStack
from typing import Any

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from flows import startup
from flows.progress import RunProgress
from flows.restarts import worth_retrying
from flows.runner import Timer, TrainingRun, mean_over_ranks
from infra.artifacts import ensure_quickstart_artifacts
from infra.cluster.cluster import Cluster
from infra.cluster.roles import RolloutRole
from infra.tracking.tracker import RunTracker
from infra.workers.environments import EnvironmentPool
from infra.workers.rewards import RewardPool
from infra.workers.teacher import TeacherRole
from rl_core.agents.rollout import display_texts, truncation_warning
from rl_core.batch.dynamic_sampling import DynamicSampling, Round, Selected, round_pass_rates
from rl_core.config import PosttrainConfig
from rl_core.evaluation.hacking import HackingWatch
from rl_core.placement.run_shape import batch_row_multiple
from rl_core.preflight.machine import check_memory
from rl_core.rewards import success_reward, successes
from rl_core.rewards.configured import reward_names
from tasks.annotate import annotate_task
from tasks.critic import values_task
from tasks.evaluate import evaluate_task
from tasks.reward import reward_task
from tasks.rollout import episodes_task, rollout_task, sync_task
from tasks.teacher import distill_task, teacher_task
from tasks.train import train_task
from tasks.validate import validate_task


def run_on_policy(cfg: PosttrainConfig, recipe: str, overrides: list[str], *, with_teacher: bool = False) -> dict:
    """The on-policy step loop shared by the GRPO family and OPD (called inside their flows).

    `with_teacher` (OPD) adds a frozen teacher role and, after `annotate`, the `teacher` and
    `distill` phases; everything else — resume, tracking, cadence, checkpoints — is the same.
    """
    startup.mark("flow")  # the Prefect API is up and the flow run created
    logger = get_run_logger()
    # inputs first: bad data or a plan that does not fit fails before the run directory is touched
    ensure_quickstart_artifacts(cfg, announce=logger.info)
    role = RolloutRole.build(cfg)
    # the preflight plan again, with the data's real longest prompt (an agent task: its whole episode budget)
    check_memory(cfg, role.max_model_len - cfg.rollout.max_tokens)
    run = TrainingRun.prepare(cfg, recipe, overrides, announce=logger.info)
    startup.mark("inputs")  # data, tokenizer, resume plan
    retry = {"retries": cfg.job.task_retries, "retry_delay_seconds": cfg.job.retry_delay_s,
             "retry_condition_fn": worth_retrying}
    rollout = rollout_task.with_options(**retry)
    reward = reward_task.with_options(**retry)
    episodes = episodes_task.with_options(**retry)
    agents = role.task.environment is not None  # an agent task: its rollout is episodes of the environment

    group_relative = cfg.rl.objective.group_relative  # the gate checks groups
    ro = cfg.rollout
    decider = success_reward(cfg.data.success_reward, reward_names(cfg.data, role.task))  # a completion's success
    overlap = cfg.rl.async_steps > 0  # later steps' rollouts in flight while a step trains (preflight: separate engines)
    step = run.start_step
    with run, RunTracker() as tracker, ExitStack() as placed:
        # the MLflow run opens first: meanwhile the trainer actors that `posttrain run` started early finish importing
        run.start(tracker, train=role.train, val=role.val)
        startup.mark("tracking")  # the MLflow run
        cluster = placed.enter_context(Cluster(cfg, max_model_len=role.max_model_len))
        placed.enter_context(run.checkpoints_of(cluster))  # the checkpoint in flight is published however steps end
        teacher = placed.enter_context(TeacherRole(cfg, cluster.trainer_group)) if with_teacher else None
        rewards_pool = placed.enter_context(RewardPool(cfg, cluster.placement, cluster.trainer_group))
        environments = placed.enter_context(EnvironmentPool(cfg)) if agents else None
        startup.mark("cluster")  # Ray, the actors, their models
        engines = cluster.engines
        version = run.restore(cluster, role.sampler, logger.info, teacher,  # a resume's restore, the first sync
                              rewards_pool)

        def log(record: dict) -> None:
            run.log(record, bar)

        # a learned reward: watch for the held-out reward rising while accuracy falls (val/reward_hacking)
        hacking = HackingWatch(logger.warning) if any(e.model or e.judge for e in cfg.data.rewards) else None

        def evaluate() -> dict:
            # `step` at the call: the step whose weights the engines hold (start_step before the loop, 0 before training)
            out = evaluate_task.with_options(**retry)(quote(engines), quote(role.tokenizer), quote(role.val),
                                                      quote(cfg.data), cfg.rollout.max_tokens, quote(rewards_pool),
                                                      step=step, **role.episode_options,
                                                      environments=quote(environments))
            return {**out, **hacking.check(out)} if hacking is not None else out

        def draw(at_step: int, at_version: int, at_round: int = 0, count: int | None = None) -> tuple[list[int], Any]:
            """The prompt rows of step `at_step` and their rollout with the engines' weights (policy `at_version`): a
            Prefect future, in flight from now on, with rl.async_steps; else the call that runs it. `at_round` >= 1: an
            extra round of dynamic sampling, `count` prompts, with its own seed. The rows are the sampler's next, but
            for a step that was in flight at the checkpoint this run resumed from: that step's rows again."""
            startup.mark("first_rollout")
            rows = run.in_flight_rows.pop(0) if at_round == 0 and run.in_flight_rows else role.sampler.next_batch(count)
            key = {"config": run.cfg_hash, "step": at_step, "version": at_version, "rows": rows}
            identity = quote({**key, "round": at_round} if at_round else key)
            sampling = quote(role.sampling(at_step, at_round))
            if agents:  # an environment's episodes, turn by turn
                phase, args = episodes, (quote(engines), quote(role.task), quote([role.train[i] for i in rows]),
                                         quote(role.tokenizer), cfg.rollout.n, sampling,
                                         {**role.episode_options, "mixed_versions": bool(cfg.rl.async_steps)}, identity)
            else:
                phase, args = rollout, (quote(engines), quote(role.prompts(rows)), cfg.rollout.n, sampling, identity)
            cache_dir = str((run.run_dir / "cache").resolve())
            more = {"environments": quote(environments)} if agents else {}
            if overlap:
                return rows, phase.submit(*args, cache_dir=cache_dir, step=at_step, **more)
            return rows, lambda: phase(*args, cache_dir=cache_dir, step=at_step, **more)

        def collect(pending: Any) -> tuple[Any, float]:
            """A drawn rollout's (completions, seconds in the engines' generate), waiting for it."""
            return pending.result() if overlap else pending()

        def score_round(rows: list[int], completions: Any, at_step: int) -> tuple[Round, list[str]]:
            """One round's rewards, and its completions as text; the sampler observes its groups' pass rates (the
            curriculum's feedback)."""
            examples = [role.train[rows[i]] for i in completions.prompt_index.tolist()]
            texts = display_texts(completions, role.tokenizer)
            scores = reward(quote(rewards_pool), quote(examples), quote(texts), quote(completions.episodes),
                            step=at_step)
            gathered = Round(rows, completions, scores, successes(scores, decider))
            role.sampler.observe(*round_pass_rates(gathered))
            return gathered, texts

        def filter_rounds(at_step: int, first: Round, timer: Timer) -> tuple[Selected | None, DynamicSampling, float]:
            """Dynamic sampling: rounds of the sampler's next prompts until the step has rollout.prompts_per_step
            useful groups or rollout.filter_max_rounds extra rounds ran; the batch (None: the step trains nothing),
            the rounds, and the extra rounds' seconds inside the engines' generate."""
            picker = DynamicSampling(ro.prompts_per_step, std_min=ro.filter_reward_std_min,
                                     max_rounds=ro.filter_max_rounds, fallback=ro.filter_fallback)
            picker.add(first)
            generate_s = 0.0
            while picker.wants_more():
                rows, pending = draw(at_step, version, len(picker.rounds), picker.next_size())
                with timer.phase("rollout"):
                    completions, seconds = collect(pending)
                generate_s += seconds
                with timer.phase("reward"):
                    picker.add(score_round(rows, completions, at_step)[0])
            return picker.select(), picker, generate_s

        run.finish_pending_evaluation(evaluate, logger.info)
        with RunProgress(cfg.rl.max_steps, cfg.job.name, step) as bar:
            if cfg.rl.validation.before_training and step == 0:
                log({"step": 0, **evaluate()})
            ahead: deque = deque()  # rl.async_steps: (rows, future) of the next steps, in flight
            warned: set[str] = set()  # the limits a warning named already: most of a step's episodes cut by each
            while step < cfg.rl.max_steps:
                step += 1
                timer = Timer()
                rows, pending = ahead.popleft() if ahead else draw(step, version)
                # the steps up to step + rl.async_steps sample with this version while this one trains (the gate
                # bounds the lag); submitted before this step's rollout is awaited, in step order
                while overlap and len(ahead) < cfg.rl.async_steps and step + len(ahead) < cfg.rl.max_steps:
                    ahead.append(draw(step + len(ahead) + 1, version))
                with timer.phase("rollout"):
                    completions, generate_s = collect(pending)
                with timer.phase("reward"):
                    first, texts = score_round(rows, completions, step)
                scores, padding, filtered = first.scores, [], {}
                if ro.filter_groups:
                    selected, picker, more_s = filter_rounds(step, first, timer)
                    generate_s += more_s
                    filtered = {"data/generated_rows": [r for g in picker.rounds for r in g.rows],
                                **picker.stats()}
                    if selected is None:  # nothing to train: the step counts, the policy stays
                        record = {"step": step, "data/prompt_rows": [], **filtered, **timer.laps,
                                  "perf/step_s": timer.elapsed(), "perf/generate_s": generate_s,
                                  "perf/policy_version": version, **startup.take()}
                        run.end_step(cluster, step, role.sampler.state_dict(), version, record, evaluate, bar,
                                     [r for r, _ in ahead])
                        continue
                    rows, completions, scores, padding = (selected.rows, selected.completions, selected.scores,
                                                          selected.padding)
                    texts = display_texts(completions, role.tokenizer)
                rewards, reward_means = scores.rewards, scores.means
                examples = [role.train[rows[i]] for i in completions.prompt_index.tolist()]
                run.sample(step, examples, texts, rewards, completions.finish_reason, scores.values, completions)
                with timer.phase("annotate"):
                    # sample ids unique over the run: an agent episode's rows are at most rollout.max_turns, and
                    # the filler fewer than its episodes (batch_row_multiple divides them)
                    stride = len(rewards) * (ro.max_turns + 1 if agents else 1)
                    annotated = annotate_task(quote(completions), quote(rewards), quote(rows), quote(cfg.rl),
                                              (step - 1) * stride, quote(padding), batch_row_multiple(cfg), step=step)
                if cfg.rl.objective.has_critic:
                    with timer.phase("values"):
                        annotated = values_task(quote(cluster), quote(annotated), quote(cfg.rl), step=step)
                if teacher is not None:
                    with timer.phase("teacher"):
                        scored = teacher_task(quote(teacher), quote(annotated.batch), step=step)
                    with timer.phase("distill"):
                        annotated = distill_task(quote(annotated), quote(scored), quote(cfg.rl), step=step)
                with timer.phase("validate"):
                    validate_task(quote(annotated), cfg.rollout.max_response_tokens, group_relative,
                                  (version - cfg.rl.async_steps, version), step=step)
                staleness, most_stale = completions.staleness(version)  # over its tokens (in-flight updates: mixed)
                lags = {f"rollout/tokens_lag_{k}": share for k, share in
                        completions.lag_fractions(version, cfg.rl.async_steps).items()} if cfg.rl.async_steps else {}
                with timer.phase("train"):
                    per_rank = train_task(quote(cluster), quote(annotated.batch), step=step)
                with timer.phase("sync"):
                    version += 1
                    synced = sync_task(quote(cluster), version, step=step)
                step_s = timer.elapsed()
                train_s = max(m["perf/train_compute_s"] for m in per_rank)
                record = {"step": step, "data/prompt_rows": rows, **mean_over_ranks(per_rank), **annotated.stats,
                          **reward_means, **filtered,
                          **timer.laps, **synced, "perf/step_s": step_s, "perf/generate_s": generate_s,
                          "perf/tokens_per_s": float(annotated.batch.loss_mask.sum()) / step_s,
                          "perf/policy_version": version, "rollout/policy_staleness": staleness,
                          "rollout/policy_staleness_max": float(most_stale), **lags,
                          **startup.take()}
                # orchestration overhead: step wall time not spent sampling or in forward/backward (overlapped: not
                # spent in the longer of the two)
                record["perf/overhead_s"] = step_s - (max(generate_s, train_s) if overlap else generate_s + train_s)
                if agents and (cut := truncation_warning(record, cfg.rollout)) and cut[0] not in warned:
                    warned.add(cut[0])
                    logger.warning("step %d: %s", step, cut[1])
                # the sampler after every draw and observation so far, and the rows of the steps in flight: a
                # resumed run draws those steps' rows again, then goes on from that state
                run.end_step(cluster, step, role.sampler.state_dict(), version, record, evaluate, bar,
                             [r for r, _ in ahead])
        return run.finish(cluster, step, logger.info)
