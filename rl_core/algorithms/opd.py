"""On-policy distillation (OPD): config -> Objective (docs/objectives.md).

The student samples, a frozen teacher scores the student's sampled tokens at the loss temperature,
and the teacher's log-probs reach the trainer as a declared batch field, `Trajectory.teacher_logp
[B, T]` (0 off the loss mask). Notation: `ℓ_{i,t}` the student's log-prob of its sampled token,
`ℓ^T_{i,t}` the teacher's, `ℓ^old` the sampling policy's (π_old = `rollout_logp` on-policy),
`M` the loss mask, `γ = rl.objective.discount`, `sg[·]` stop-gradient.

Both modes train through the clipped surrogate (`clipped_policy_gradient_loss`, token level, with
per-token advantages `[B, T]`) and `reduce_policy_gradient_loss(rl.objective.loss_type)`, `Reduction.TOKEN_SUM`
with the chunk weight reported: the GRPO machinery, so micro-batch and data-parallel invariance hold
by the same argument (docs/pitfalls.md: distillation normalisation).

`rl.objective.distillation_mode = "advantage"` (default). The advantage is an annotation made from batch
fields before dispatch (`opd_annotate`, which calls the pure `opd_token_advantages`):

    A_{i,t} = Σ_{t' ≥ t} γ^{t'−t} M_{i,t'} · (−kl_coef · sg[ℓ^old_{i,t'} − ℓ^T_{i,t'}])  +  w · A^group_i

with `kl_coef = rl.objective.kl_coef`, `w = rl.objective.task_reward_weight` and `A^group` the task reward's
group advantage (docs/objectives.md; `[B]` broadcast over tokens). `ℓ^old` is the *sampling* policy's
log-prob (`rollout_logp`), not the current forward: the advantage is fixed when the batch is
collected and shared by every mini-batch, exactly like a GRPO advantage. `γ = 0` is the per-token
advantage `−kl_coef · (ℓ^old − ℓ^T)`; `γ = 1` the undiscounted log-ratio to go.

`rl.objective.distillation_mode = "direct"` minimises the sampled reverse KL `KL(π ‖ π_T)` of the student's
own samples. `E_{y~π}[ℓ − ℓ^T]` depends on θ through the sampling distribution, so backpropagating
through `ℓ − sg[ℓ^T]` alone has expected gradient `E[∇ℓ] = 0` on-policy; the correct estimator
is the score-function (REINFORCE) form

    c_{i,t} = Σ_{t' ≥ t} γ^{t'−t} M_{i,t'} sg[ℓ_{i,t'} − ℓ^T_{i,t'}]      (ℓ from the current forward)
    ∇ ≈ Σ_t c_{i,t} ∇ℓ_{i,t},       on-policy surrogate  loss_{i,t} = sg[c_{i,t}] · ℓ_{i,t}

(`reverse_kl_surrogate`). With `γ = 0` its expectation is the token-level (myopic) reverse-KL
gradient `Σ_t E_{y<t}[∇_θ KL(π(·|y<t) ‖ π_T(·|y<t))]` (the prefix distribution held fixed); with
`γ = 1` it is the exact gradient of the sequence-level `KL(π ‖ π_T) = E_y[Σ_t ℓ_t − ℓ^T_t]`
(past-token terms have zero expectation). The objective applies it as the clipped surrogate with
`A_{i,t} = −c_{i,t}` and π_old from the old-logp cache: on-policy (`n_mini = 1`) its value is
`c_{i,t}` and its gradient exactly `c_{i,t} ∇ℓ_{i,t}`; with several mini-batches per batch the
token ratio is the importance correction to the samples of π_old, clipped like GRPO.

Advantage vs direct: on-policy with `kl_coef = 1`, `w = 0` and the same γ, both have the same
expected gradient (a tested identity, up to `rollout_logp` vs the trainer's ℓ). Direct recomputes
the coefficient from the trainer's current forward at every update (no engine log-prob noise, no
stale coefficient on later mini-batches) and reports the sampled KL as its loss; advantage can mix
in the task reward. Task reward and group advantage are not training signals in direct mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from rl_core.algorithms.base import (
    ClipKnobs,
    GroupAdvantageKnobs,
    LossSettings,
    LossTypeKnob,
    Report,
    non_default,
)
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.surrogates import SURROGATES, corrected, loss_and_metrics, metric_names
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import (
    LogprobScorer,
    MetricAdapter,
    Objective,
    OldLogpCache,
    Reduction,
    frozen_token_logprobs,
)
from rl_core.primitives.policy_gradient import reduce_policy_gradient_loss

# algorithm-local name -> public suffix (published as train/<suffix>)
OPD_METRIC_NAMES: dict[str, str] = metric_names("opd", "reverse_kl")


# ---------------------------------------------------------------------------------- pure functions


def discounted_future_sum(values: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """`R_{i,t} = Σ_{t' ≥ t} γ^{t'−t} M_{i,t'} v_{i,t'}` on loss positions, 0 off them. `[B, T]` -> `[B, T]`.

    The exponent counts positions (`t' − t`); positions with `M = 0` add nothing (their values may
    be anything, inf included) but still count in the exponent, so a masked hole inside a response
    discounts what follows it. `γ = 0` returns `M · v`; `γ = 1` the masked reverse cumulative sum.
    Keeps the dtype of `values`; differentiable (callers pass detached values where needed).
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(values.shape)} to match the values")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount={discount}: must be in [0, 1] (rl.objective.discount)")
    on = mask.to(values.dtype) > 0
    v = torch.where(on, values, torch.zeros_like(values))
    if discount == 0.0 or v.shape[-1] == 0:
        return v
    if discount == 1.0:
        out = v.flip(-1).cumsum(-1).flip(-1)
    else:
        cols = [None] * v.shape[-1]
        running = torch.zeros_like(v[:, 0])
        for t in range(v.shape[-1] - 1, -1, -1):
            running = v[:, t] + discount * running
            cols[t] = running
        out = torch.stack(cols, dim=-1)
    return torch.where(on, out, torch.zeros_like(out))


def opd_token_advantages(rollout_logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                         kl_coef: float, discount: float = 0.0) -> torch.Tensor:
    """Per-token OPD advantage (advantage mode, without the task term). `[B, T]` x3 -> `[B, T]`.

        A_{i,t} = Σ_{t' ≥ t} γ^{t'−t} M_{i,t'} · (−kl_coef · sg[ℓ^old_{i,t'} − ℓ^T_{i,t'}])

    `rollout_logp` is the sampling policy's log-prob ℓ^old, `teacher_logp` the teacher's, both at the
    loss temperature. A stop-gradient annotation: the result is detached, 0 off the mask, and exactly
    0 where student and teacher agree. Computed in float32 at least (float64 input stays float64).
    """
    if teacher_logp.shape != rollout_logp.shape or loss_mask.shape != rollout_logp.shape:
        raise ValueError(f"rollout_logp {list(rollout_logp.shape)}, teacher_logp {list(teacher_logp.shape)} and "
                         f"loss_mask {list(loss_mask.shape)} must all be [B, T]")
    if not kl_coef > 0:
        raise ValueError(f"kl_coef={kl_coef}: must be > 0 (rl.objective.kl_coef)")
    dtype = torch.promote_types(rollout_logp.dtype, torch.float32)
    with torch.no_grad():
        log_ratio = rollout_logp.detach().to(dtype) - teacher_logp.detach().to(dtype)
        return discounted_future_sum(-kl_coef * log_ratio, loss_mask, discount)


def reverse_kl_coefficients(logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                            discount: float = 0.0) -> torch.Tensor:
    """Direct mode's score-function coefficient `c_{i,t} = Σ_{t'≥t} γ^{t'−t} M sg[ℓ_{t'} − ℓ^T_{t'}]` (detached)."""
    if teacher_logp.shape != logp.shape:
        raise ValueError(f"teacher_logp has shape {tuple(teacher_logp.shape)}; expected {tuple(logp.shape)} to "
                         "match logp")
    with torch.no_grad():
        return discounted_future_sum(logp.detach() - teacher_logp.detach().to(logp.dtype), loss_mask, discount)


def reverse_kl_surrogate(logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                         discount: float = 0.0) -> torch.Tensor:
    """On-policy direct-mode surrogate per token: value `c_{i,t}`, gradient `c_{i,t} ∇ℓ_{i,t}`. `[B, T]`.

        loss_{i,t} = sg[c_{i,t}] · (ℓ_{i,t} − sg[ℓ_{i,t}] + 1)

    For samples of π, `E[Σ_t c_t ∇ℓ_t]` is the token-level reverse-KL gradient (γ = 0) or the exact
    sequence-level `∇ KL(π ‖ π_T)` (γ = 1); see the module docstring. Not masked: reduce it with
    `reduce_policy_gradient_loss`. The objective uses the same estimator through the clipped
    surrogate (`A = −c`, identical value and gradient on-policy).
    """
    c = reverse_kl_coefficients(logp, teacher_logp, loss_mask, discount=discount)
    return c * (logp - logp.detach() + 1.0)


# ---------------------------------------------------------------------------------- annotate phase


def teacher_logprobs(teacher: torch.nn.Module, batch, *, temperature: float,
                     micro_batch_size: int | None = None) -> torch.Tensor:
    """The teacher role's per-token log-probs of the student's sampled tokens: `[B, T]` float32, 0 off the loss mask.

    Same primitive as the trainer's forward (`LogprobScorer`, `log_softmax(logits / T)` at
    `T = rollout.temperature`), no grad, in chunks of `micro_batch_size` rows. The teacher must share the
    student's tokenizer (the token ids are the student's). Store the result as
    `batch.replace(teacher_logp=...)`.
    """
    return frozen_token_logprobs(teacher, batch, temperature=temperature, micro_batch_size=micro_batch_size)


def row_shards(rows: int, parts: int) -> list[tuple[int, int]]:
    """`[start, stop)` of `parts` contiguous row shards of `rows` rows, in order, sizes differing by at most one
    (the first `rows % parts` one larger); fewer, never empty, when `rows < parts`."""
    if parts < 1:
        raise ValueError(f"parts={parts}: must be >= 1 (cluster.teacher_replicas)")
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for i in range(min(parts, rows)):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def score_in_shards(batch, parts: int, score: Callable[[list[Any]], list[torch.Tensor]]) -> torch.Tensor:
    """`teacher_logp [B, T]` of `batch` scored as `row_shards(B, parts)` by `score(shards) -> [logp [b_i, T]]`
    (e.g. one teacher replica per shard, in parallel), reassembled in row order.

    Each row's log-probs depend on that row alone, so this equals scoring the whole batch at once
    (`teacher_logprobs`), up to the floating-point effect of the rows a forward runs with.
    """
    bounds = row_shards(batch.batch_size, parts)
    shards = [batch.select(list(range(start, stop))) for start, stop in bounds]  # copies: each ships only its rows
    parts_logp = score(shards)
    if len(parts_logp) != len(shards):
        raise ValueError(f"the teacher returned {len(parts_logp)} shard(s) of log-probs for {len(shards)} shard(s)")
    for (start, stop), shard, logp in zip(bounds, shards, parts_logp):
        if tuple(logp.shape) != (stop - start, shard.seq_len):
            raise ValueError(f"the teacher's log-probs of rows {start}:{stop} have shape {tuple(logp.shape)}; "
                             f"expected {(stop - start, shard.seq_len)}")
    return torch.cat(parts_logp, 0) if parts_logp else torch.zeros(0, batch.seq_len)


def check_teacher_logp(batch) -> None:
    """`batch.teacher_logp` present, `[B, T]`, finite and ≤ 0 on loss tokens; ValueError naming the rows."""
    t = getattr(batch, "teacher_logp", None)
    if t is None:
        raise ValueError("batch.teacher_logp is missing: OPD needs the teacher's log-probs of the sampled tokens; "
                         "score the batch with rl_core.algorithms.opd.teacher_logprobs(teacher, batch, ...) first")
    on = batch.loss_mask > 0
    bad = on & ~(torch.isfinite(t) & (t <= 1e-6))
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(-1)).flatten().tolist()
        raise ValueError(f"batch.teacher_logp is not a finite log-prob (<= 0) on the loss tokens of rows {rows[:8]}")


def opd_annotate(batch, rl) -> tuple[Any, dict[str, float]]:
    """The OPD annotate step, on complete groups, after the teacher scored the batch.

    advantage mode: `advantages [B, T] = opd_token_advantages(rollout_logp, teacher_logp, loss_mask,
    kl_coef, γ) + w · A^group` (the group advantage of the task reward with the objective's
    `unbiased_advantage` / `advantage_eps`, only when `w = task_reward_weight > 0`), 0 off the loss mask.
    `rl` is the rl config section; its `objective` is an `OPD`.
    direct mode: the batch is returned unchanged (its advantages, if any, are logged only).
    Stats (`opd/...`): `teacher_reverse_kl` (mean of `ℓ^old − ℓ^T` over loss tokens, the sampled
    per-token reverse KL), `teacher_logp_mean`, and in advantage mode `kl_advantage_mean` (mean of the
    teacher term of the advantage over loss tokens).
    """
    opd = _opd(rl)
    check_teacher_logp(batch)
    mask = batch.loss_mask.float()
    n_tok = mask.sum().clamp_min(1)
    k1 = torch.where(mask > 0, batch.rollout_logp.float() - batch.teacher_logp.float(), torch.zeros_like(mask))
    stats = {
        "opd/teacher_reverse_kl": float(k1.sum() / n_tok),
        "opd/teacher_logp_mean": float((torch.where(mask > 0, batch.teacher_logp.float(), 0.0)).sum() / n_tok),
    }
    if opd.distillation_mode == "direct":
        return batch, stats
    adv = opd_token_advantages(batch.rollout_logp, batch.teacher_logp, batch.loss_mask,
                               kl_coef=opd.kl_coef, discount=opd.discount).float()
    stats["opd/kl_advantage_mean"] = float((adv * mask).sum() / n_tok)
    if opd.task_reward_weight > 0:
        from rl_core.annotators.advantage import group_advantages

        group = group_advantages(batch.rewards.float(), batch.group_ids, unbiased=opd.unbiased_advantage,
                                 eps=opd.advantage_eps).float()
        adv = adv + opd.task_reward_weight * group.unsqueeze(-1) * mask
    return batch.replace(advantages=adv), stats


# -------------------------------------------------------------------------------------- objective


class OPDLoss:
    """`fn(model, batch) -> (loss, metrics)` of OPD; `Reduction.TOKEN_SUM`.

    Per token the clipped surrogate with `A [B, T]`: `batch.advantages` (advantage mode, from
    `opd_annotate`) or `−reverse_kl_coefficients(ℓ, teacher_logp, M, γ)` of the current forward
    (direct mode). `loss = numerator / weight` from `reduce_policy_gradient_loss(loss_type)`,
    `metrics[OBJECTIVE_WEIGHT_SUM] = weight`. `opd_reverse_kl` is `sg[ℓ − ℓ^T]` (current ℓ) under
    the same reduction, so it combines over chunks to the unsplit value.
    """

    def __init__(self, settings: LossSettings, old_logp_cache: OldLogpCache | None):
        self.settings = settings
        self.old_logp_cache = old_logp_cache

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.settings
        check_teacher_logp(batch)
        direct = s.distillation_mode == "direct"
        if not direct:
            adv = batch.advantages
            if adv is None or adv.dim() != 2:
                raise ValueError("batch.advantages must be per token ([B, T]) for rl.objective.distillation_mode=advantage: "
                                 "annotate the batch with rl_core.algorithms.opd.opd_annotate(batch, rl) first"
                                 + ("" if adv is None else f" (got shape {list(adv.shape)})"))
        logp, entropy = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                temperature=s.temperature, return_entropy=True,
                                                loss_mask=batch.loss_mask)
        entropy = entropy.detach()
        mask = batch.loss_mask.to(logp.dtype)
        teacher = batch.teacher_logp.to(logp.dtype)
        if direct:
            adv = -reverse_kl_coefficients(logp, teacher, mask, discount=s.discount)
        if self.old_logp_cache is None:
            old = batch.old_logp if batch.old_logp is not None else logp.detach()
        else:
            old = self.old_logp_cache.lookup(batch.sample_ids, batch.policy_version, logp)
        per_token, stats = SURROGATES["clipped"].fn(logp, old, adv, mask, s)  # token level: OPD has no other
        per_token, stats = corrected(per_token, stats, old, batch.rollout_logp, mask, s)
        numerator, weight = reduce_policy_gradient_loss(per_token, mask, s.loss_type,
                                                        max_response_length=s.max_response_length)
        with torch.no_grad():
            k1 = torch.where(mask > 0, logp.detach() - teacher, torch.zeros_like(logp))
            kl_num, _ = reduce_policy_gradient_loss(k1, mask, s.loss_type, max_response_length=s.max_response_length)
        return loss_and_metrics("opd", numerator, weight, pg_numerator=numerator, stats=stats, logp=logp,
                                rollout_logp=batch.rollout_logp, entropy=entropy, advantages=adv, mask=mask,
                                own={"reverse_kl": kl_num})


class OPD(GroupAdvantageKnobs, LossTypeKnob, ClipKnobs):
    """On-policy distillation: the clipped surrogate (token ratios) against a frozen teacher's log-probs.

    The teacher model is `model.teacher`; `cluster.teacher_replicas` places its copies. The group-advantage knobs
    are read only in advantage mode with `task_reward_weight > 0`.
    """

    TOPOLOGY: ClassVar = "teacher"
    type: Literal["opd"] = "opd"
    importance_sampling_level: Literal["token"] = Field("token", description="OPD's advantages are per token, so its ratios are too (fixed by the type).")
    distillation_mode: Literal["advantage", "direct"] = Field("advantage", description="Teacher signal as per-token advantage, or direct reverse-KL minimisation.")
    kl_coef: float = Field(1.0, gt=0, description="Advantage mode: per-token advantage -kl_coef * (logp - teacher_logp).")
    discount: float = Field(0.0, ge=0, le=1, description="Discount over future tokens' teacher log-ratios; 0 is per token, 1 the undiscounted sum to the end.")
    task_reward_weight: float = Field(0.0, ge=0, description="Advantage mode: weight of the task-reward group advantage added to the teacher advantage; 0 disables.")

    @model_validator(mode="after")
    def _mode_reads(self):
        unread = []
        if self.distillation_mode == "direct":
            unread = ["kl_coef", "task_reward_weight", "unbiased_advantage", "advantage_eps", "shared_prefix_min_tokens"]
            why = "not read by distillation_mode=direct"
        elif non_default(self, "shared_prefix_min_tokens"):
            unread, why = ["shared_prefix_min_tokens"], ("not read by OPD (the teacher's per-token signal is not shared "
                                                         "across a group's common prefix)")
        elif self.task_reward_weight == 0:
            unread, why = ["unbiased_advantage", "advantage_eps"], "a group-advantage knob, read only when task_reward_weight > 0"
        for knob in unread:
            if non_default(self, knob):
                raise ValueError(f"{knob}={getattr(self, knob)!r}: {why}")
        return self

    @property
    def min_group_size(self) -> int:
        return 1 if self.distillation_mode == "direct" else 2  # direct mode reads no group advantage

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        super().check(cfg, err, warn, n_mini)
        if self.distillation_mode == "direct":
            warn("rl.objective.distillation_mode=direct: task reward and group advantage are logged but are not "
                 "training signals")

    def identity(self, rl: Any, context: ObjectiveContext) -> dict[str, Any]:
        ident: dict[str, Any] = {
            "objective": "opd",
            "distillation_mode": self.distillation_mode,
            "opd_discount": self.discount,
            "grpo_surrogate": "clipped",
            "importance_sampling_level": "token",
            "epsilon_low": self.epsilon_low,
            "epsilon_high": self.epsilon_high,
            "lower_bound_ratio": self.lower_bound_ratio,
            **self.correction_identity(),
            "loss_type": self.loss_type,
            "fixed_divisor": context.max_response_length if self.loss_type == "seq-mean-token-sum-fixed" else None,
            "temperature": context.temperature,
        }
        if self.distillation_mode == "advantage":
            ident["opd_kl_coef"] = self.kl_coef
            ident["opd_task_reward_weight"] = self.task_reward_weight
            if self.task_reward_weight > 0:
                ident["unbiased_advantage"] = self.unbiased_advantage
                if not self.unbiased_advantage:
                    ident["advantage_eps"] = self.advantage_eps
        ident.update(self.truncation_identity())
        ident["policy"] = dict(context.policy_identity)
        return ident

    def build(self, rl: Any, context: ObjectiveContext) -> Objective:
        """The teacher is not part of the objective: its log-probs arrive as `batch.teacher_logp`
        (see `teacher_logprobs`)."""
        cache = OldLogpCache(LogprobScorer(context.temperature),
                             certified_deterministic_forward=self.certified_deterministic_forward,
                             accelerator_atol=self.certified_forward_atol)
        return Objective(
            fn=OPDLoss(LossSettings(self, context.temperature, context.max_response_length), cache),
            reduction=Reduction.TOKEN_SUM,
            metric_adapter=MetricAdapter(metric_names("opd", "reverse_kl", corrected=self.rollout_correction != "off")),
            old_logp_cache=cache,
            reference_scorer=None,
            identity=self.identity(rl, context),
        )


def _opd(rl) -> OPD:
    if not isinstance(rl.objective, OPD):
        raise ValueError(f"rl.objective.type={rl.objective.type}: not an OPD objective (rl.objective.type=opd)")  # noqa: TRY004 - a config error
    return rl.objective


def build_objective(rl, context: ObjectiveContext) -> Objective:
    """The OPD Objective of an `rl` config section whose `objective` is an `OPD`."""
    return _opd(rl).build(rl, context)
