"""The preflight memory plan: bytes per process of every role, before anything is placed or loaded.

`memory_plan(cfg, shape, prompt_tokens=...)` itemises what one process of each role holds, per
phase of a step, from the model's dimensions (`ModelShape`) and the config alone:

- trainer rank (`cluster.num_workers` of them): float32 parameters, gradients and AdamW state
  (divided by the ranks under `cluster.sharding=fsdp`), the compute-dtype weight copies, the
  activations and logits of one micro-batch, the frozen reference, the weight-sync buffers,
  colocated, the rollout engine and, OPD, the teacher replicas on the rank's GPU (their own processes:
  frozen weights, CUDA runtime and one scoring chunk each, `teachers_per_rank` of them);
- separate rollout engine (`cluster.placement=separate`): its weights and KV cache or vLLM's reservation.

Phases: forward/backward (F), optimizer step (S), weight sync (W), generation (G), DPO's one-off
reference scoring (R), the OPD teacher's scoring (T). Gradients are released after each step, so
they never meet the rollout; a phase's total is the sum of the items present in it and a role's
peak is its largest phase. The formulas and the measurements behind them are in docs/gpu.md.

The plan's parts, one module each in this package: `model_shape` (the model's dimensions), `formulas` (the
constants and byte formulas), `items` (a role's items and peak), `roles` (what each role holds), `host_memory`
(one node's host RAM). `MemoryPlan.render()` is the table `posttrain validate` prints; `MemoryPlan.problems()`
lists the roles whose peak exceeds 90% of their GPU share (`USABLE_FRACTION`), each with the knobs that would make
it fit, most effective first (each one re-planned). Nothing here touches a GPU or downloads anything:
`model_shape` reads `config.json` from a local directory or the Hugging Face cache and builds the model on the
meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rl_core.config.schema import PosttrainConfig
from rl_core.placement import host_memory
from rl_core.placement.formulas import (
    ASSUMED_PROMPT_TOKENS,
    GENERATE,
    PHASE_LETTERS,
    SCORE,
    SYNC,
    USABLE_FRACTION,
    micro_batch_rows,
)
from rl_core.placement.host_memory import HostPlan
from rl_core.placement.items import RolePlan, gib, params_text
from rl_core.placement.model_shape import ModelShape, model_shape, probe_model_shape
from rl_core.placement.roles import (
    add_critic_on_rank,
    add_reward_models_on_rank,
    add_teachers_on_rank,
    engine_role,
    trainer_role,
)
from rl_core.placement.run_shape import (
    num_engines,
    per_replica_batch,
    reward_model_replicas,
    rows_per_prompt,
    shard_mesh,
    teacher_replicas,
    teachers_per_rank,
)


@dataclass
class MemoryPlan:
    cfg: PosttrainConfig
    shape: ModelShape
    roles: list[RolePlan]
    prompt_tokens: int
    gpu_bytes: int | None = None
    gpu_source: str = ""
    teacher_shape: ModelShape | None = None
    reference_shape: ModelShape | None = None
    assumed_prompt: bool = False
    host: HostPlan | None = None
    remote_ray: bool = False

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.cfg.rollout.max_tokens

    def role(self, key: str) -> RolePlan:
        for r in self.roles:
            if r.key == key:
                return r
        raise KeyError(key)

    def available(self, role: RolePlan) -> int | None:
        """Memory one process of `role` may plan for: `USABLE_FRACTION` of its share of a GPU (a fractional
        GPU shares it)."""
        if self.gpu_bytes is None or not role.on_gpu:
            return None
        return int(self.gpu_bytes * min(role.gpus, 1.0) * USABLE_FRACTION)

    # -- rendering
    def render(self) -> str:
        cfg, s = self.cfg, self.shape
        prompt = f"{self.prompt_tokens} prompt{' (assumed)' if self.assumed_prompt else ''}"
        if not any(r.on_gpu for r in self.roles):
            device = "no GPU role: host memory, not enforced"
        elif self.gpu_bytes is None:
            device = "GPU memory unknown (set cluster.gpu_memory_gib): printed, not enforced"
        else:
            device = f"{gib(self.gpu_bytes)} GiB per GPU ({self.gpu_source})"
        head = (f"memory plan (per process, GiB = 2^30 B): {s.architecture or 'model'} {params_text(s.n_params)} "
                f"params, compute {cfg.model.compute_dtype}, sequence {prompt} + {cfg.rollout.max_tokens} response = "
                f"{self.seq_len} tokens, train micro-batch {micro_batch_rows(cfg)} rows; {device}")
        lines = [
            head,
            "  phases: " + ", ".join(f"{v} {k}" for k, v in PHASE_LETTERS.items()
                                     if any(k in r.phases for r in self.roles)),
        ]
        for role in self.roles:
            where = (f"{role.gpus:g} GPU each" if role.on_gpu else "on CPU: host memory, not checked")
            lines.append(f"  {role.title} (x{role.processes}, {where})")
            lines.append(f"    {'GiB':>8}  {'phases':<6}  item")
            for it in role.items:
                phases = "all" if it.phases is None else "".join(PHASE_LETTERS[p] for p in it.phases)
                note = f"  [{it.note}]" if it.note else ""
                lines.append(f"    {gib(it.bytes):>8}  {phases:<6}  {it.name}{note}")
            totals = role.phase_bytes()
            lines.append("    phase totals: " + ", ".join(f"{ph} {gib(b)}" for ph, b in totals.items()))
            avail = self.available(role)
            verdict = ("" if avail is None else
                       f" of {gib(avail)} GiB usable ({USABLE_FRACTION:.0%} of its GPU): "
                       + ("fits" if role.peak <= avail else "DOES NOT FIT"))
            lines.append(f"    peak {gib(role.peak)} GiB ({role.peak_phase}){verdict}")
            lines += [f"    note: {n}" for n in role.notes]
        if self.host is not None:
            lines += host_memory.render(self.host)
        return "\n".join(lines)

    # -- problems and the knobs that fix them
    def problems(self) -> list[str]:
        """Roles on GPU that do not fit the GPU memory (none when it is unknown), and a node whose host memory does not
        fit its RAM (none when that is unknown), each with its fixes."""
        out = []
        if self.host is not None and not self.host.fits():
            sharded = None
            if shard_mesh(self.cfg) is None and (cfg := _variant(self.cfg, {"cluster.sharding": "fsdp"})) is not None:
                sharded = self._replan(cfg).host.peak
            out.append(host_memory.problem(self.host, self.cfg, sharded))
        for role in self.roles:
            avail = self.available(role)
            if avail is None:
                continue
            if role.vllm_reservation is not None and role.vllm_weights >= role.vllm_reservation:
                need = math.ceil((role.vllm_weights * 1.25 / self.gpu_bytes) * 20) / 20
                dtype_fix = "" if self.cfg.model.compute_dtype == "bfloat16" else " or model.compute_dtype=bfloat16"
                out.append(f"{role.title}: vLLM's weights ({gib(role.vllm_weights)} GiB in "
                           f"{self.cfg.model.compute_dtype}) do not fit its reservation rollout.gpu_memory_utilization="
                           f"{self.cfg.rollout.gpu_memory_utilization:g} x {gib(self.gpu_bytes)} GiB = "
                           f"{gib(role.vllm_reservation)} GiB; set rollout.gpu_memory_utilization={min(need, 0.95):g} "
                           f"(the weights + 25% for the KV cache){dtype_fix}")
            if role.peak <= avail:
                continue
            out.append(f"{role.title} (x{role.processes}): peak {gib(role.peak)} GiB in the {role.peak_phase} phase "
                       f"exceeds the {gib(avail)} GiB usable ({USABLE_FRACTION:.0%} of "
                       f"{self.gpu_source or 'its GPU'}); "
                       f"{self._fixes(role, avail)}")
        return out

    def _source(self) -> str:
        return f" ({self.gpu_source})" if self.gpu_source else ""

    def _replan(self, cfg: PosttrainConfig) -> MemoryPlan:
        host = self.host
        return memory_plan(cfg, self.shape, prompt_tokens=self.prompt_tokens, gpu_bytes=self.gpu_bytes,
                           teacher_shape=self.teacher_shape, reference_shape=self.reference_shape,
                           host_bytes=host.host_bytes if host else None, host_source=host.source if host else "",
                           remote_ray=self.remote_ray)

    def _fixes(self, role: RolePlan, avail: int) -> str:
        tried = []
        for overrides in _knobs(self, role, avail):
            cfg = _variant(self.cfg, overrides)
            if cfg is None:
                continue
            try:
                peak = self._replan(cfg).role(role.key).peak
            except KeyError:  # the role is gone (e.g. no colocated engine)
                continue
            if peak < role.peak:
                tried.append((peak, overrides))
        if not tried:
            return "no knob of this config lowers it: use GPUs with more memory or a smaller model"
        tried.sort(key=lambda t: t[0])
        each = ", ".join(f"{_label(o)} ({gib(p)} GiB{', fits' if p <= avail else ''})" for p, o in tried)
        text = f"knobs that lower it, most effective first (the peak each gives alone): {each}"
        if tried[0][0] <= avail:
            return text
        combined: dict[str, Any] = {}
        peak = role.peak
        for _, overrides in tried:
            cfg = _variant(self.cfg, {**combined, **overrides})
            if cfg is None:
                continue
            new_peak = self._replan(cfg).role(role.key).peak
            if new_peak < peak:
                combined.update(overrides)
                peak = new_peak
            if peak <= avail:
                return f"{text}; together `{_label(combined)}` give {gib(peak)} GiB (fits)"
        return f"{text}; even together `{_label(combined)}` give {gib(peak)} GiB: use GPUs with more memory"


def _label(overrides: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in overrides.items())


def _variant(cfg: PosttrainConfig, overrides: dict[str, Any]) -> PosttrainConfig | None:
    """A copy of `cfg` with dotted `overrides` applied (None when a value is refused)."""
    from pydantic import ValidationError

    new = cfg.model_copy(deep=True)
    try:
        for dotted, value in overrides.items():
            section, key = dotted.split(".")
            setattr(getattr(new, section), key, value)
    except ValidationError:
        return None
    return new


def _smaller_micro_batch(cfg: PosttrainConfig, current: int) -> int | None:
    """The largest micro-batch at most half of `current` that divides the mini-batch (even for DPO)."""
    per = per_replica_batch(cfg)
    mini = cfg.rl.mini_batch_per_replica or per
    step = cfg.rl.objective.rows_per_prompt(1)  # whole pairs for DPO
    for m in range(current // 2, step - 1, -1):
        if m % step == 0 and mini and mini % m == 0:
            return m
    return None


def _fitting_utilization(plan: MemoryPlan, role: RolePlan, avail: int) -> float | None:
    """A lower rollout.gpu_memory_utilization under which the role's vLLM phases fit (None: none helps)."""
    if role.vllm_reservation is None or not plan.gpu_bytes:
        return None
    totals = role.phase_bytes()
    held = [ph for ph in totals if role.vllm_phases is None or ph in role.vllm_phases]
    if any(totals[ph] > avail for ph in totals if ph not in held):
        return None  # a phase without vLLM's reservation does not fit: a lower utilization cannot help
    worst_other = max(totals[ph] - role.vllm_reservation for ph in (SYNC, GENERATE, SCORE) if ph in held)
    util = math.floor((avail - worst_other) / plan.gpu_bytes * 20) / 20
    if util >= plan.cfg.rollout.gpu_memory_utilization or util * plan.gpu_bytes <= role.vllm_weights * 1.25:
        return None
    return util


def _knobs(plan: MemoryPlan, role: RolePlan, avail: int) -> list[dict[str, Any]]:
    cfg = plan.cfg
    cl, model, ro = cfg.cluster, cfg.model, cfg.rollout
    out: list[dict[str, Any]] = []
    if model.compute_dtype == "float32":
        out.append({"model.compute_dtype": "bfloat16"})
    if role.key == "trainer":
        if cl.sharding == "none" and cl.num_workers > 1:
            out.append({"cluster.sharding": "fsdp"})
        if not model.gradient_checkpointing:
            out.append({"model.gradient_checkpointing": True})
        if (m := _smaller_micro_batch(cfg, micro_batch_rows(cfg))) is not None:
            out.append({"rl.micro_batch_per_replica": m})
        if cl.placement == "colocated":
            if (u := _fitting_utilization(plan, role, avail)) is not None:
                out.append({"rollout.gpu_memory_utilization": u})
            out.append({"cluster.placement": "separate", **({"cluster.gpus_per_engine": 1.0} if role.on_gpu else {})})
        total = ro.prompts_per_step * rows_per_prompt(cfg)
        more = cl.num_workers * 2
        if total % more == 0 and (cfg.rl.objective.topology != "offline" or ro.prompts_per_step % more == 0):
            out.append({"cluster.num_workers": more})
    elif role.key == "engine":
        if (u := _fitting_utilization(plan, role, avail)) is not None:
            out.append({"rollout.gpu_memory_utilization": u})
        if ro.backend == "hf":
            out.append({"rollout.num_engines": num_engines(cfg) * 2})
    if role.key == "trainer" and teachers_per_rank(cfg) > 1:
        out.append({"cluster.teacher_replicas": cl.num_workers})
    return out

def memory_plan(cfg: PosttrainConfig, shape: ModelShape, *, prompt_tokens: int, gpu_bytes: int | None = None,
                teacher_shape: ModelShape | None = None, reference_shape: ModelShape | None = None,
                gpu_source: str = "", assumed_prompt: bool = False, host_bytes: int | None = None,
                host_source: str = "", remote_ray: bool = False,
                reward_model_shapes: list[tuple[int, ModelShape | None]] | None = None) -> MemoryPlan:
    """The per-role, per-process byte plan of `cfg` for a policy of `shape` (see the module docstring), and the host
    memory of one node (`rl_core.placement.host_memory`).

    `prompt_tokens`: the longest prompt (`ASSUMED_PROMPT_TOKENS` when unknown); sequences are that
    plus `rollout.max_tokens`. `gpu_bytes`: memory of one GPU (None: printed, not enforced).
    `teacher_shape` (OPD) and `reference_shape` (`rl.reference`; default: the policy's shape);
    `reward_model_shapes`: `(data.rewards index, shape)` of the reward models beside each rank. `host_bytes`: the RAM
    of one node (None: printed, not enforced); `remote_ray`: the ranks run on a Ray cluster's nodes, not here.
    """
    roles = [trainer_role(cfg, shape, prompt_tokens, gpu_bytes, reference_shape or shape)]
    if teacher_replicas(cfg):
        add_teachers_on_rank(cfg, roles[0], teacher_shape, prompt_tokens)
    if cfg.rl.objective.has_critic:
        add_critic_on_rank(cfg, roles[0], shape, prompt_tokens)
    if reward_model_shapes:
        add_reward_models_on_rank(cfg, roles[0], reward_model_shapes, prompt_tokens, gpu_bytes)
    if cfg.cluster.placement == "separate" and cfg.rl.objective.trains_policy:
        roles.append(engine_role(cfg, shape, prompt_tokens, gpu_bytes))
    host = host_memory.host_plan(cfg, shape.n_params, shape.n_param_tensors, shape.linears, remote_ray=remote_ray,
                                 host_bytes=host_bytes, source=host_source)
    return MemoryPlan(cfg, shape, roles, prompt_tokens, gpu_bytes, gpu_source, teacher_shape, reference_shape,
                      assumed_prompt, host, remote_ray)

def plan_for_config(cfg: PosttrainConfig, gpu_bytes: int | None = None, *, gpu_source: str = "",
                    prompt_tokens: int | None = None, host_bytes: int | None = None, host_source: str = "",
                    remote_ray: bool = False) -> tuple[MemoryPlan | None, str]:
    """`(plan, "")` from the model configs on this machine, or `(None, why there is none)`. Never downloads."""
    shape, why = probe_model_shape(cfg.model.name_or_path, cfg.model.trust_remote_code)
    if shape is None:
        return None, f"model.name_or_path={why}"
    teacher = reference = None
    if cfg.rl.objective.topology == "teacher" and cfg.model.teacher:
        teacher = model_shape(cfg.model.teacher, cfg.model.trust_remote_code)
    if cfg.rl.reference:
        reference = model_shape(cfg.rl.reference, cfg.model.trust_remote_code)
    rewards = [(i, reward_model_shape(e.model or e.judge.model, cfg.model.trust_remote_code))
               for i, e in enumerate(cfg.data.rewards) if e.model is not None or (e.judge and e.judge.model)] \
        if reward_model_replicas(cfg) else None
    return memory_plan(cfg, shape, prompt_tokens=prompt_tokens or ASSUMED_PROMPT_TOKENS, gpu_bytes=gpu_bytes,
                       teacher_shape=teacher, reference_shape=reference, gpu_source=gpu_source,
                       assumed_prompt=prompt_tokens is None, host_bytes=host_bytes, host_source=host_source,
                       remote_ray=remote_ray, reward_model_shapes=rewards), ""


def reward_model_shape(name_or_path: str, trust_remote_code: bool) -> ModelShape | None:
    """The shape of a `data.rewards` model (a finished run's directory: its final model); None when not here."""
    from rl_core.rewards.model import resolve_reward_model

    try:
        return model_shape(resolve_reward_model(name_or_path, "data.rewards"), trust_remote_code)
    except ValueError:  # no model at a local path: preflight's rules name it
        return None
