"""Preflight (docs/config.md): cross-field rules checked before any placement or model construction.

Errors: the temperature contract, knobs that the selected objective never reads set to non-default
values, group size, batch divisibility. Warnings: knobs that are honoured but inert or risky; each
distinct warning is emitted once per process through `logging` and `warnings`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

from rl_core.config.schema import PosttrainConfig, RLConfig
from rl_core.lora import lora_problems
from rl_core.placement.run_shape import (
    TEACHER_GPU_SHARE,
    num_mini_batches,
    rows_per_prompt,
    teacher_replicas,
    teachers_per_rank,
)
from rl_core.primitives.policy_gradient import clip_settings_problem
from rl_core.registry import ALGORITHMS, algorithm, names, user_code_problems

log = logging.getLogger("posttrain.preflight")
_RL_DEFAULTS = RLConfig()
_EMITTED: set[str] = set()
OPD_ADVANTAGE_ONLY_KNOBS = ("opd_kl_coef", "opd_task_reward_weight")


class PreflightWarning(UserWarning):
    """An honoured but inert or risky knob."""


@dataclass
class PreflightReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        lines = [f"preflight: {'ok' if self.ok else 'FAILED'} ({len(self.errors)} error(s), {len(self.warnings)} warning(s))"]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _non_default(rl: RLConfig, name: str) -> bool:
    return getattr(rl, name) != getattr(_RL_DEFAULTS, name)


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _matching(knob: str, value: object) -> str:
    """The registered algorithms whose `requires` accepts rl.<knob>=value (for the error's hint)."""
    fits = [n for n, s in ALGORITHMS.items() if s.requires.get(knob, value) == value]
    return "one of " + ", ".join(fits) if fits else "none is registered"


def preflight(cfg: PosttrainConfig) -> PreflightReport:
    rep = PreflightReport()
    err, warn = rep.errors.append, rep.warnings.append
    rl, ro, algo = cfg.rl, cfg.rollout, cfg.job.algorithm
    sequence = rl.importance_sampling_level == "sequence"
    clipped = rl.grpo_surrogate == "clipped"
    opd_advantage = algo == "opd" and rl.distillation_mode == "advantage"
    opd_direct = algo == "opd" and rl.distillation_mode == "direct"
    n_mini = num_mini_batches(cfg)
    spec = algorithm(algo)

    # -- the registry's rules: what job.algorithm fixes, owns and never reads (rl_core/registry.py)
    for knob, required in spec.requires.items():
        if getattr(rl, knob) != required:
            err(f"rl.{knob}={_show(getattr(rl, knob))}: job.algorithm={algo} requires rl.{knob}={_show(required)}; set "
                f"it, or pick the job.algorithm that matches ({_matching(knob, getattr(rl, knob))})")
    for other in ALGORITHMS.values():
        if other.name != algo:
            for knob in other.owns:
                if _non_default(rl, knob):
                    err(f"rl.{knob}={getattr(rl, knob)!r}: only read by job.algorithm={other.name}")
    for knob in spec.unread:
        if _non_default(rl, knob):
            err(f"rl.{knob}={getattr(rl, knob)!r}: not read by job.algorithm={algo} ({spec.summary}); remove it")
    rep.errors.extend(user_code_problems(cfg))  # rl.custom_objective / data.custom_reward: imported and checked

    # -- the temperature contract
    if algo != "dpo":
        if clipped and ro.temperature != rl.temperature:
            err(f"rollout.temperature={ro.temperature} != rl.temperature={rl.temperature}: the clipped surrogate "
                "compares sampling and training log-probs, which must use the same temperature; set both equal")
        if not clipped:
            if ro.temperature != 1.0:
                err(f"rollout.temperature={ro.temperature}: rl.grpo_surrogate=legacy_pg needs rollout.temperature=1.0")
            if _non_default(rl, "temperature"):
                err(f"rl.temperature={rl.temperature}: rl.grpo_surrogate=legacy_pg reads no rl.temperature; leave it at "
                    f"its default {_RL_DEFAULTS.temperature}")

    # -- knobs the selected objective never reads
    if not clipped:
        for knob in ("importance_sampling_level", "epsilon_low", "epsilon_high", "lower_bound_ratio",
                     "certified_deterministic_forward", "certified_forward_atol"):
            if _non_default(rl, knob):
                err(f"rl.{knob}={getattr(rl, knob)!r}: not read by rl.grpo_surrogate=legacy_pg (no ratio, no clip, no "
                    f"pi_old); remove it or use rl.grpo_surrogate=clipped")
        if n_mini > 1:
            err(f"rl.mini_batch_per_replica={rl.mini_batch_per_replica}: gives {n_mini} updates per batch, but "
                "rl.grpo_surrogate=legacy_pg is on-policy only (one update per rollout); remove it or use clipped")
    if rl.async_steps:
        if spec.topology != "on_policy":
            err(f"rl.async_steps={rl.async_steps}: only the GRPO family's step loop overlaps rollout and training, not "
                f"job.algorithm={algo}; set rl.async_steps=0")
        elif not clipped:
            err(f"rl.async_steps={rl.async_steps}: a stale batch needs the importance ratio against the rollout's "
                "log-probs, which rl.grpo_surrogate=legacy_pg does not have; use rl.grpo_surrogate=clipped "
                "(job.algorithm=grpo) or rl.async_steps=0")
        if cfg.cluster.placement != "separate":
            err(f"rl.async_steps={rl.async_steps} with cluster.placement={cfg.cluster.placement}: colocated engines run "
                "inside the trainer actors, which serve one call at a time, so nothing would overlap; set "
                "cluster.placement=separate")
        if rl.certified_deterministic_forward:
            err("rl.certified_deterministic_forward=true with rl.async_steps: pi_old of a stale batch is the rollout's "
                "log-probs, not a trainer forward that could be certified; turn one of them off")
    if clipped and (problem := clip_settings_problem(rl.lower_bound_ratio, rl.importance_sampling_level, "rl.")):
        err(problem)
    if sequence and opd_advantage:
        err("rl.importance_sampling_level=sequence: OPD's advantage mode gives per-token advantages, which a sequence "
            "ratio cannot take; use rl.importance_sampling_level=token")
    if rl.kl_beta == 0 and algo != "dpo":
        for knob in ("kl_estimator", "reference"):
            if _non_default(rl, knob):
                err(f"rl.{knob}={getattr(rl, knob)!r}: not read while rl.kl_beta=0; set rl.kl_beta > 0 or remove it")
    if opd_direct:
        for knob in ("unbiased_advantage", "advantage_eps", "shared_prefix_min_tokens") + OPD_ADVANTAGE_ONLY_KNOBS:
            if _non_default(rl, knob):
                err(f"rl.{knob}={getattr(rl, knob)!r}: an advantage knob, not read by rl.distillation_mode=direct")
    if spec.topology != "teacher" and cfg.model.teacher is not None:
        err(f"model.teacher={cfg.model.teacher!r}: only read by job.algorithm={','.join(names(topology='teacher'))} "
            "(the teacher role)")
    if algo == "opd":
        if opd_advantage and _non_default(rl, "shared_prefix_min_tokens"):
            err(f"rl.shared_prefix_min_tokens={rl.shared_prefix_min_tokens}: not read by OPD (the teacher's "
                "per-token signal is not shared across a group's common prefix)")
        if opd_advantage and rl.opd_task_reward_weight == 0:
            for knob in ("unbiased_advantage", "advantage_eps"):
                if _non_default(rl, knob):
                    err(f"rl.{knob}={getattr(rl, knob)!r}: a group-advantage knob, only read by OPD when "
                        "rl.opd_task_reward_weight > 0")
    if algo == "dpo" and rl.micro_batch_per_replica is not None and rl.micro_batch_per_replica % 2:
        err(f"rl.micro_batch_per_replica={rl.micro_batch_per_replica}: DPO rows come in (chosen, rejected) "
            "pairs, so a micro-batch must hold an even number of rows")
    if rl.micro_batch_max_tokens is not None and rl.micro_batch_max_tokens <= ro.max_tokens:
        err(f"rl.micro_batch_max_tokens={rl.micro_batch_max_tokens}: a micro-batch must hold at least one whole row, "
            f"a prompt plus up to rollout.max_tokens={ro.max_tokens} response tokens; set it above the longest prompt "
            "+ rollout.max_tokens")
    if algo == "dpo" and rl.micro_batch_max_tokens is not None:
        err(f"rl.micro_batch_max_tokens={rl.micro_batch_max_tokens}: DPO's loss is a mean over the pairs of a chunk "
            "(Reduction.MEAN), so its chunks must hold equal numbers of pairs; use rl.micro_batch_per_replica")
    rep.errors.extend(data_problems(cfg))

    if _non_default(rl, "certified_forward_atol") and not rl.certified_deterministic_forward:
        err(f"rl.certified_forward_atol={rl.certified_forward_atol:g}: read only with "
            "rl.certified_deterministic_forward=true; set that, or remove this")

    # -- group size and batch shape
    if spec.group_relative and ro.n < 2 and not opd_direct:
        err(f"rollout.n={ro.n}: group-relative advantages need at least 2 completions per prompt")
    total = ro.prompts_per_step * rows_per_prompt(cfg)
    if algo == "dpo" and ro.prompts_per_step % cfg.cluster.num_workers:
        err(f"rollout.prompts_per_step={ro.prompts_per_step} (DPO: pairs per step) does not split into whole pairs "
            f"across cluster.num_workers={cfg.cluster.num_workers}")
    elif total % cfg.cluster.num_workers:
        err(f"rollout.prompts_per_step x rollout.n = {total} completions do not split evenly across "
            f"cluster.num_workers={cfg.cluster.num_workers}")
    else:
        per = total // cfg.cluster.num_workers
        mini = rl.mini_batch_per_replica or per
        if algo == "dpo" and mini % 2:
            err(f"rl.mini_batch_per_replica={mini}: DPO rows come in (chosen, rejected) pairs, so a mini-batch must "
                "hold an even number of rows")
        if per % mini:
            err(f"rl.mini_batch_per_replica={mini} does not divide the {per} completions per worker "
                f"(prompts_per_step x n / num_workers)")
        elif rl.micro_batch_per_replica and mini % rl.micro_batch_per_replica:
            err(f"rl.micro_batch_per_replica={rl.micro_batch_per_replica} does not divide the mini-batch of {mini} "
                "completions per worker")

    # -- placement
    cl = cfg.cluster
    if cl.placement == "colocated" and ro.num_engines not in (None, cl.num_workers):
        err(f"rollout.num_engines={ro.num_engines} with cluster.placement=colocated: colocated engines are one per "
            f"trainer rank (cluster.num_workers={cl.num_workers}); leave rollout.num_engines unset, or set "
            "cluster.placement=separate for engines on their own devices")
    if cl.placement == "colocated" and (cl.cpus_per_engine != 1.0 or cl.gpus_per_engine != 0.0):
        err("cluster.cpus_per_engine/gpus_per_engine are read only by cluster.placement=separate: colocated engines use "
            "their trainer rank's CPUs/GPUs")
    if cl.num_workers > 1 and cl.gpus_per_worker > 0 and cl.gpus_per_worker != int(cl.gpus_per_worker):
        err(f"cluster.gpus_per_worker={cl.gpus_per_worker:g} with cluster.num_workers={cl.num_workers}: NCCL needs one "
            "whole GPU per rank (two ranks on one GPU cannot form an NCCL group); use a whole number")
    if cl.placement == "separate" and cl.gpus_per_engine > 1 and cl.gpus_per_engine != int(cl.gpus_per_engine):
        err(f"cluster.gpus_per_engine={cl.gpus_per_engine:g}: above 1 it must be a whole number of GPUs (vLLM's "
            "tensor_parallel_size)")
    if cl.placement == "separate" and cl.gpus_per_engine > 1 and ro.backend != "vllm":
        err(f"cluster.gpus_per_engine={cl.gpus_per_engine:g} with rollout.backend={ro.backend}: the HF engine runs on "
            "one GPU; an engine over several GPUs is vLLM with tensor_parallel_size=cluster.gpus_per_engine "
            "(rollout.backend=vllm), or set cluster.gpus_per_engine=1")
    if spec.topology != "teacher" and cl.teacher_replicas is not None:
        err(f"cluster.teacher_replicas={cl.teacher_replicas}: only read by job.algorithm="
            f"{','.join(names(topology='teacher'))} (the teacher role); remove it")
    if spec.topology == "teacher" and cl.gpus_per_worker > 1:
        err(f"cluster.gpus_per_worker={cl.gpus_per_worker:g} with job.algorithm={algo}: the teacher replicas share a "
            "trainer rank's GPU, and Ray splits a GPU between actors only below one whole GPU; use "
            "cluster.gpus_per_worker=1")
    elif spec.topology == "teacher" and 0 < cl.gpus_per_worker <= teachers_per_rank(cfg) * TEACHER_GPU_SHARE:
        err(f"cluster.teacher_replicas={teacher_replicas(cfg)} on cluster.num_workers={cl.num_workers} ranks of "
            f"cluster.gpus_per_worker={cl.gpus_per_worker:g}: {teachers_per_rank(cfg)} teacher(s) per rank leave the "
            "rank no GPU share in Ray; lower cluster.teacher_replicas or raise cluster.gpus_per_worker")

    rep.errors.extend(lora_problems(cfg))  # model.lora with sharding / vLLM (rl_core/lora.py)

    # -- honoured but inert or risky
    if cl.sharding == "hsdp":
        if cl.shard_size is None:
            err(f"cluster.sharding=hsdp needs cluster.shard_size: the ranks of one shard group (the GPUs of a node); "
                f"cluster.num_workers={cl.num_workers} ranks then form num_workers/shard_size replicas")
        elif cl.num_workers % cl.shard_size:
            fits = [d for d in range(2, cl.num_workers) if cl.num_workers % d == 0]
            err(f"cluster.shard_size={cl.shard_size} does not divide cluster.num_workers={cl.num_workers}: HSDP's mesh "
                f"is num_workers/shard_size replicas of shard_size ranks; sizes that divide: "
                f"{', '.join(map(str, fits)) or f'none (use cluster.sharding=fsdp over {cl.num_workers} ranks)'}")
        elif cl.shard_size == cl.num_workers:
            err(f"cluster.shard_size={cl.shard_size} = cluster.num_workers: one shard group over every rank is "
                "cluster.sharding=fsdp; set that, or a smaller shard_size")
    elif cl.shard_size is not None:
        err(f"cluster.shard_size={cl.shard_size} is read only by cluster.sharding=hsdp (cluster.sharding="
            f"{cl.sharding}); remove it")
    if cl.sharding == "fsdp" and cl.num_workers == 1:
        warn("cluster.sharding=fsdp with cluster.num_workers=1 shards nothing (one rank holds everything); the model "
             "trains unsharded. Shard across cluster.num_workers > 1 ranks")
    if ro.backend == "vllm" and cl.placement == "colocated" and cl.gpus_per_worker == 0:
        warn("rollout.backend=vllm with cluster.placement=colocated on CPU: vLLM's CPU build then runs inside the "
             "trainer process, which it changes (thread binding, the global seed); prefer cluster.placement=separate")
    if clipped and sequence:
        if n_mini == 1:
            warn("rl.importance_sampling_level=sequence at one update per batch (n_mini=1) is inert: on-policy both "
                 "levels give the same value and gradient; set rl.mini_batch_per_replica to take several updates")
        if max(rl.epsilon_low, rl.epsilon_high) >= 0.05:
            warn(f"rl.epsilon_low/high={rl.epsilon_low}/{rl.epsilon_high} are token-scale; sequence ratios want "
                 "~3e-4/4e-4 (GSPO paper)")
        if rl.loss_type != "seq-mean-token-mean":
            warn(f"rl.loss_type={rl.loss_type}: a sequence ratio under a token-weighted reduction weights sequences "
                 "by length; GSPO's setting is seq-mean-token-mean")
    if clipped and ro.top_p < 1 and algo != "dpo":
        warn(f"rollout.top_p={ro.top_p} < 1 under a ratio-based surrogate: sampling log-probs come from the "
             "truncated distribution the trainer does not model")
    if algo == "dpo" and ro.max_logp_abs_diff is not None:
        err(f"rollout.max_logp_abs_diff={ro.max_logp_abs_diff:g}: job.algorithm=dpo samples nothing, so there is no "
            "sampler-vs-trainer log-prob gap to bound; remove it")
    if opd_direct:
        warn("rl.distillation_mode=direct: task reward and group advantage are logged but are not training signals")
    return rep


def emit_warnings(report: PreflightReport) -> None:
    """Show each distinct warning once per process (logging and the warnings module)."""
    for message in report.warnings:
        if message in _EMITTED:
            continue
        _EMITTED.add(message)
        log.warning(message)
        warnings.warn(message, PreflightWarning, stacklevel=2)


def check(cfg: PosttrainConfig) -> PreflightReport:
    """Run preflight; raise ConfigError listing every error, else emit warnings and return the report."""
    from rl_core.config.loader import ConfigError

    report = preflight(cfg)
    if not report.errors:  # the machine is probed once the config itself is clean
        from rl_core.config.environment import environment_problems

        report.errors.extend(environment_problems(cfg))
    if report.errors:
        raise ConfigError(report.errors, "preflight")
    emit_warnings(report)
    return report


# The configuration checked by the entry (before Prefect starts), handed to the flow it starts, so one run
# loads and preflights its configuration once: (recipe, overrides) -> config. One slot, taken once.
_handed_over: dict[tuple[str, tuple[str, ...]], PosttrainConfig] = {}


def load_checked(recipe: str, overrides: list[str] | tuple[str, ...] = (), *, hand_over: bool = False) -> PosttrainConfig:
    """`load_config` + `check` (raising ConfigError), unless the caller before this one in the same process
    checked the same recipe and overrides with `hand_over=True` (the CLI entry, before it starts the flow):
    then that config is taken, once. The flows call it plainly; a deployment's flow run always loads afresh."""
    from rl_core.config.loader import load_config

    key = (str(recipe), tuple(overrides))
    handed = _handed_over.pop(key, None)
    if handed is not None:
        return handed
    cfg = load_config(recipe, list(overrides))
    check(cfg)
    if hand_over:
        _handed_over.clear()
        _handed_over[key] = cfg.model_copy(deep=True)
    return cfg


def data_problems(cfg: PosttrainConfig) -> list[str]:
    """Keys of the data section that the task or the rewards never read, and reward names that collide."""
    from rl_core.tasks import get_task

    d, out = cfg.data, []
    try:
        task = get_task(d.task)
    except ValueError:
        return out  # named by user_code_problems
    if d.reward_mode != "strict" and ("reward_mode" not in task.reads or d.rewards):
        reader = "data.rewards replaces the task's reward" if d.rewards else f"data.task={d.task!r} does not read it"
        out.append(f"data.reward_mode={d.reward_mode!r}: only the GSM8K task's own reward reads it ({reader})")
    if not d.rewards:
        try:
            task.default_rewards(d)
        except ValueError as exc:
            out.append(str(exc))
    names = [e.name or e.path.rpartition(":")[2].rpartition(".")[2] for e in d.rewards]
    for i, name in enumerate(names):
        if name in names[:i]:
            out.append(f"data.rewards[{i}]: a second reward named {name!r} (their metrics would mix); give it a "
                       "name (data.rewards[i].name)")
    if d.rewards and not any(e.weight for e in d.rewards):
        out.append("data.rewards: every weight is 0, so every reward would be 0; give one a weight")
    return out

