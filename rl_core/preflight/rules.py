"""Preflight (docs/config.md): cross-field rules checked before any placement or model construction.

Errors: group size, batch divisibility, placement; what involves the
objective and another section is the objective class's own `check` (rl_core/algorithms/), called
from here. Warnings: knobs that are honoured but inert or risky; each distinct warning is emitted
once per process through `logging` and `warnings`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

from rl_core.config.schema import PosttrainConfig
from rl_core.model.lora import lora_problems
from rl_core.placement.run_shape import (
    TEACHER_GPU_SHARE,
    num_mini_batches,
    rows_per_prompt,
    teacher_replicas,
    teachers_per_rank,
)
from rl_core.user_code import user_code_problems

log = logging.getLogger("posttrain.preflight")
_EMITTED: set[str] = set()


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




def preflight(cfg: PosttrainConfig) -> PreflightReport:
    rep = PreflightReport()
    err, warn = rep.errors.append, rep.warnings.append
    rl, ro, cl, objective = cfg.rl, cfg.rollout, cfg.cluster, cfg.rl.objective
    kind, topology = objective.type, objective.topology

    objective.check(cfg, err, warn, num_mini_batches(cfg))  # what involves the objective and another section (rl_core/algorithms/)
    rep.errors.extend(user_code_problems(cfg))  # data.rewards by import path: imported and checked
    for i, entry in enumerate(cfg.data.rewards):  # reward models (their directories: rl_core.preflight.machine)
        if entry.model is not None and not objective.trains_policy:
            err(f"data.rewards[{i}].model: rl.objective.type={kind} trains a reward model and scores no completion; "
                "remove the reward model from data.rewards")

    if rl.async_steps:
        if topology != "on_policy":
            err(f"rl.async_steps={rl.async_steps}: only the on-policy step loop overlaps rollout and training, not "
                f"rl.objective.type={kind}; set rl.async_steps=0")
        if cl.placement != "separate":
            err(f"rl.async_steps={rl.async_steps} with cluster.placement={cl.placement}: colocated engines run "
                "inside the trainer actors, which serve one call at a time, so nothing would overlap; set "
                "cluster.placement=separate")
    if ro.in_flight_updates:
        if not rl.async_steps:
            err("rollout.in_flight_updates=true with rl.async_steps=0: no rollout is in flight when a sync lands; set "
                "rl.async_steps >= 1 or remove it")
        if ro.backend != "hf":
            err(f"rollout.in_flight_updates=true with rollout.backend={ro.backend}: the vLLM engine finishes the "
                "requests in flight before it takes new weights; set rollout.backend=hf or remove it")
    if cfg.model.routing_replay != "off":
        replay = f"model.routing_replay={cfg.model.routing_replay}"
        if topology == "offline":
            err(f"{replay} with rl.objective.type={kind}: offline pairs have no rollout nor pi_old pass to take routes "
                "from; set model.routing_replay=off")
        if cfg.model.routing_replay == "old" and rl.async_steps:
            err(f"{replay} with rl.async_steps={rl.async_steps}: a stale batch's pi_old is its rollout log-probs, with "
                "no trainer pass to record routes; use model.routing_replay=rollout")
        certified = getattr(objective, "certified_deterministic_forward", False)  # an ahead pi_old pass anyway
        if cfg.model.routing_replay == "old" and num_mini_batches(cfg) == 1 and not certified:
            warn(f"{replay} with one mini-batch per step: the training forward is pi_old's own, so there is nothing to "
                 "replay; it matters with rl.mini_batch_per_replica below the batch (docs/moe.md)")
    if rl.reference is not None and not objective.reads_reference:
        err(f"rl.reference={rl.reference!r}: not read by rl.objective.type={kind} without a KL anchor; set "
            "rl.objective.kl_beta > 0 or remove it")
    if topology != "teacher" and cfg.model.teacher is not None:
        err(f"model.teacher={cfg.model.teacher!r}: only read by an objective with a teacher (rl.objective.type=opd)")
    if rl.micro_batch_max_tokens is not None and rl.micro_batch_max_tokens <= ro.max_tokens:
        err(f"rl.micro_batch_max_tokens={rl.micro_batch_max_tokens}: a micro-batch must hold at least one whole row, "
            f"a prompt plus up to rollout.max_tokens={ro.max_tokens} response tokens; set it above the longest prompt "
            "+ rollout.max_tokens")
    rep.errors.extend(data_problems(cfg))
    rep.errors.extend(sampling_problems(cfg))

    # -- group size and batch shape
    if ro.n < objective.min_group_size:
        err(f"rollout.n={ro.n}: group-relative advantages need at least {objective.min_group_size} completions per "
            "prompt")
    total = ro.prompts_per_step * rows_per_prompt(cfg)
    if total % cl.num_workers:
        err(f"rollout.prompts_per_step x {rows_per_prompt(cfg)} rows = {total} rows do not split evenly across "
            f"cluster.num_workers={cl.num_workers}")
    else:
        per = total // cl.num_workers
        mini = rl.mini_batch_per_replica or per
        if per % mini:
            err(f"rl.mini_batch_per_replica={mini} does not divide the {per} completions per worker "
                f"(prompts_per_step x n / num_workers)")
        elif rl.micro_batch_per_replica and mini % rl.micro_batch_per_replica:
            err(f"rl.micro_batch_per_replica={rl.micro_batch_per_replica} does not divide the mini-batch of {mini} "
                "completions per worker")

    # -- placement
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
    if topology != "teacher" and cl.teacher_replicas is not None:
        err(f"cluster.teacher_replicas={cl.teacher_replicas}: only read by an objective with a teacher "
            "(rl.objective.type=opd); remove it")
    if topology == "teacher" and cl.gpus_per_worker > 1:
        err(f"cluster.gpus_per_worker={cl.gpus_per_worker:g} with rl.objective.type={kind}: the teacher replicas share "
            "a trainer rank's GPU, and Ray splits a GPU between actors only below one whole GPU; use "
            "cluster.gpus_per_worker=1")
    elif topology == "teacher" and 0 < cl.gpus_per_worker <= teachers_per_rank(cfg) * TEACHER_GPU_SHARE:
        err(f"cluster.teacher_replicas={teacher_replicas(cfg)} on cluster.num_workers={cl.num_workers} ranks of "
            f"cluster.gpus_per_worker={cl.gpus_per_worker:g}: {teachers_per_rank(cfg)} teacher(s) per rank leave the "
            "rank no GPU share in Ray; lower cluster.teacher_replicas or raise cluster.gpus_per_worker")

    rep.errors.extend(lora_problems(cfg))  # model.lora with sharding / vLLM (rl_core/model/lora.py)

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
    """Run preflight; raise ConfigError listing every error, else check the data's rows (DataError listing every bad
    one, `rl_core.preflight.rows`), emit warnings and return the report."""
    from rl_core.config.explain import ConfigError

    report = preflight(cfg)
    if not report.errors:  # the machine is probed once the config itself is clean
        from rl_core.preflight.machine import machine_problems

        report.errors.extend(machine_problems(cfg))
    if report.errors:
        raise ConfigError(report.errors, "preflight")
    from rl_core.preflight.rows import check_data

    check_data(cfg).raise_errors()  # the rows the run would stop at, all of them, before anything starts
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
    """Keys of the data section that the task or the rewards never read, reward names that collide, and a success
    reward that is none of them."""
    from rl_core.rewards import success_reward
    from rl_core.rewards.configured import entry_name, reward_names
    from rl_core.tasks import get_task

    d, out = cfg.data, []
    try:
        task = get_task(d.task)
    except ValueError as exc:  # a task by import path that does not load, or an unknown name
        return [str(exc)]
    if task.environment is None:
        for key, default in (("max_turns", 1), ("max_episode_tokens", None), ("episode_scheduling", "per_episode")):
            if getattr(cfg.rollout, key) != default:
                out.append(f"rollout.{key}={getattr(cfg.rollout, key)}: read only by agent tasks (an environment in "
                           f"data.task), not by data.task={d.task!r}; remove it")
    elif cfg.model.routing_replay == "rollout" and cfg.rollout.max_turns > 1:
        out.append(f"model.routing_replay=rollout with data.task={d.task!r} and rollout.max_turns={cfg.rollout.max_turns}: "
                   "an agent episode's engine calls do not return routes; use model.routing_replay=old or off")
    if task.environment is not None and d.prompt_template == "plain":
        out.append(f"data.prompt_template={d.prompt_template!r}: an environment's episode is a chat (its turns are the "
                   f"chat template's), so data.task={d.task!r} needs data.prompt_template=chat or auto (the default)")
    if d.reward_mode != "strict" and ("reward_mode" not in task.reads or d.rewards):
        reader = "data.rewards replaces the task's reward" if d.rewards else f"data.task={d.task!r} does not read it"
        out.append(f"data.reward_mode={d.reward_mode!r}: only the GSM8K task's own reward reads it ({reader})")
    if not d.rewards:
        try:
            task.default_rewards(d)
        except ValueError as exc:
            out.append(str(exc))
    fixed = [name for name, _ in task.fixed_rewards(d)]  # an environment's own reward
    names = [entry_name(e) for e in d.rewards]
    for i, name in enumerate(names):
        if name in fixed or name in names[:i]:
            out.append(f"data.rewards[{i}]: a second reward named {name!r} (their metrics would mix); give it a "
                       "name (data.rewards[i].name)")
    if d.rewards and not fixed and not any(e.weight for e in d.rewards):
        out.append("data.rewards: every weight is 0, so every reward would be 0; give one a weight")
    if d.success_reward is not None:
        try:
            known = reward_names(d, task)
        except ValueError:  # a task without rewards of its own and no data.rewards: reported above
            known = None
        if known is not None:
            try:
                success_reward(d.success_reward, known)
            except ValueError as exc:
                out.append(f"{exc}: name one of them (the metrics' rollout/rewards/<name>/mean), or unset it for the "
                           "first")
    return out


FILTER_KNOBS = ("filter_max_rounds", "filter_fallback", "filter_reward_std_min")  # read only with filter_groups
CURRICULUM_KNOBS = ("curriculum_floor", "curriculum_ema")  # read only by data.sampler=curriculum


def _set(section, keys: tuple[str, ...]) -> list[str]:
    """The keys of `section` whose value is not the schema's default."""
    return [key for key in keys if getattr(section, key) != type(section).model_fields[key].default]


def sampling_problems(cfg: PosttrainConfig) -> list[str]:
    """Dynamic sampling (`rollout.filter_groups`) and the curriculum sampler (`data.sampler=curriculum`): where they
    apply, and their knobs only with them (docs/rollout.md, docs/data.md)."""
    ro, data, objective, out = cfg.rollout, cfg.data, cfg.rl.objective, []
    kind = objective.type
    if ro.filter_groups:
        if objective.topology != "on_policy" or not objective.group_relative:
            out.append(f"rollout.filter_groups=true with rl.objective.type={kind}: dynamic sampling drops groups "
                       "whose group-relative advantages are zero, which only the on-policy loop with group "
                       "advantages has; remove it")
    else:
        out += [f"rollout.{key}={getattr(ro, key)!r}: read only by rollout.filter_groups=true; remove it or set "
                "rollout.filter_groups=true" for key in _set(ro, FILTER_KNOBS)]
    if data.sampler == "curriculum":
        if objective.topology == "offline":
            out.append(f"data.sampler=curriculum with rl.objective.type={kind}: the curriculum draws by the pass rates "
                       "of sampled groups, and offline pairs sample none; set data.sampler=epoch")
    else:
        out += [f"data.{key}={getattr(data, key)!r}: read only by data.sampler=curriculum; remove it or set "
                "data.sampler=curriculum" for key in _set(data, CURRICULUM_KNOBS)]
    return out
