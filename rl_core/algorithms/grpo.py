"""GRPO family (GRPO, Dr-GRPO, GSPO, legacy PG): config classes and their Objective (docs/objectives.md).

`rl.objective.type` picks the class: `grpo` (clipped token ratios, group-normalised advantages),
`dr_grpo` (the same with mean-centred advantages and the fixed divisor `rollout.max_tokens`), `gspo`
(sequence-level ratios with the paper's clip range and reduction) and `legacy_pg` (−A·ℓ, on-policy,
no ratio). Dr-GRPO and GSPO are presets of GRPO: the values that define them are fixed by their
class (a different value is refused naming the key), the rest are GRPO's knobs.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from rl_core.algorithms.base import (
    ClipKnobs,
    GroupAdvantageKnobs,
    KLKnobs,
    LossSettings,
    LossTypeKnob,
    Report,
)
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.surrogates import SURROGATES, corrected, loss_and_metrics, metric_names, surrogate
from rl_core.primitives.kl import kl_penalty
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import (
    LogprobScorer,
    MetricAdapter,
    Objective,
    OldLogpCache,
    Reduction,
)
from rl_core.primitives.policy_gradient import reduce_policy_gradient_loss


def _require(value, field: str, hint: str):
    if value is None:
        raise ValueError(f"batch.{field} is missing: {hint}")
    return value


class GRPOLoss:
    """`fn(model, batch) -> (loss, metrics)` of the GRPO family; `Reduction.TOKEN_SUM`.

    loss = (Σ_chunk pg numerator + kl_beta · Σ_chunk kl numerator) / chunk weight, with numerator and
    weight from `reduce_policy_gradient_loss(loss_type)`; `metrics[OBJECTIVE_WEIGHT_SUM]` = weight.
    Reads `batch.advantages` ([B]; [B, T] only at token level), π_old from the old_logp cache
    (clipped) and `batch.ref_logp` (kl_beta > 0, filled by the trainer through `reference_scorer`).
    """

    def __init__(self, settings: LossSettings, old_logp_cache: OldLogpCache | None):
        self.settings = settings
        self.old_logp_cache = old_logp_cache

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.settings
        chosen = surrogate(s.surrogate)
        level = getattr(s, "importance_sampling_level", "token")
        adv = _require(batch.advantages, "advantages",
                       "annotate the batch with group advantages (rl_core.annotators) before training")
        if chosen.reads_old_logp and level == "sequence" and adv.dim() != 1:
            raise ValueError("batch.advantages are per token ([B, T]) but rl.objective.importance_sampling_level=sequence "
                             "needs one advantage per completion ([B]); use rl.objective.importance_sampling_level=token")
        logp, entropy = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                temperature=s.temperature, return_entropy=True,
                                                loss_mask=batch.loss_mask)
        entropy = entropy.detach()
        mask = batch.loss_mask.to(logp.dtype)

        old = None
        if chosen.reads_old_logp:
            if self.old_logp_cache is None:
                old = _require(batch.old_logp, "old_logp", f"rl.objective.surrogate={s.surrogate} needs pi_old log-probs")
            else:
                old = self.old_logp_cache.lookup(batch.sample_ids, batch.policy_version, logp)
        per_token, stats = chosen.fn(logp, old, adv, mask, s)
        if chosen.reads_old_logp:
            per_token, stats = corrected(per_token, stats, old, batch.rollout_logp, mask, s)
        pg_num, weight = reduce_policy_gradient_loss(per_token, mask, s.loss_type,
                                                     max_response_length=s.max_response_length)
        numerator, own = pg_num, {}
        if s.kl_beta > 0:
            ref = _require(batch.ref_logp, "ref_logp", "rl.objective.kl_beta > 0 needs reference log-probs; pass the reference "
                           "model to the trainer as auxiliary_models={'reference': model}")
            own["kl"], _ = reduce_policy_gradient_loss(kl_penalty(logp, ref, s.kl_estimator), mask, s.loss_type,
                                                       max_response_length=s.max_response_length)
            numerator = pg_num + s.kl_beta * own["kl"]
        loss, metrics = loss_and_metrics("grpo", numerator, weight, pg_numerator=pg_num, stats=stats, logp=logp,
                                         rollout_logp=batch.rollout_logp, entropy=entropy, advantages=adv, mask=mask,
                                         own=own)
        return loss, metrics


def policy_gradient_objective(knobs: Any, context: ObjectiveContext, identity: dict[str, Any]) -> Objective:
    """The `Objective` of `GRPOLoss` for an objective config `knobs` (the GRPO family, PPO's policy): the π_old cache
    when it `reads_old_logp`, the reference's scorer when it `reads_reference`, GRPO's metric names."""
    cache = None
    if knobs.reads_old_logp:
        cache = OldLogpCache(LogprobScorer(context.temperature),
                             certified_deterministic_forward=knobs.certified_deterministic_forward,
                             accelerator_atol=knobs.certified_forward_atol)
    return Objective(
        fn=GRPOLoss(LossSettings(knobs, context.temperature, context.max_response_length), cache),
        reduction=Reduction.TOKEN_SUM,
        metric_adapter=MetricAdapter(metric_names("grpo", "kl", corrected=getattr(knobs, "rollout_correction", "off")
                                                  != "off")),
        old_logp_cache=cache,
        reference_scorer=LogprobScorer(context.temperature) if knobs.reads_reference else None,
        identity=identity,
    )


class _PolicyGradient(GroupAdvantageKnobs, LossTypeKnob, KLKnobs):
    """What every objective of the family reads: the group advantage, the reduction and the KL anchor."""

    surrogate: str = Field("clipped", description="Policy-gradient surrogate, a name registered with @register_surrogate in rl_core.algorithms.surrogates (docs/objectives.md).")

    @property
    def reads_old_logp(self) -> bool:
        return surrogate(self.surrogate).reads_old_logp

    def identity(self, rl: Any, context: ObjectiveContext) -> dict[str, Any]:
        ident: dict[str, Any] = {"objective": "grpo", "grpo_surrogate": self.surrogate}
        if self.reads_old_logp:
            ident.update(importance_sampling_level=self.importance_sampling_level, epsilon_low=self.epsilon_low,
                         epsilon_high=self.epsilon_high, lower_bound_ratio=self.lower_bound_ratio,
                         **self.correction_identity())
        ident["loss_type"] = self.loss_type
        ident["fixed_divisor"] = context.max_response_length if self.loss_type == "seq-mean-token-sum-fixed" else None
        ident["temperature"] = context.temperature
        ident["kl_beta"] = self.kl_beta
        if self.kl_beta > 0:
            ident.update(kl_estimator=self.kl_estimator, reference=rl.reference)
        ident["unbiased_advantage"] = self.unbiased_advantage
        if not self.unbiased_advantage:
            ident["advantage_eps"] = self.advantage_eps
        ident["shared_prefix_min_tokens"] = self.shared_prefix_min_tokens
        ident.update(self.truncation_identity())
        ident["policy"] = dict(context.policy_identity)
        return ident

    def build(self, rl: Any, context: ObjectiveContext) -> Objective:
        return policy_gradient_objective(self, context, self.identity(rl, context))


class GRPO(_PolicyGradient, ClipKnobs):
    """Clipped GRPO: token importance ratios against π_old, group-normalised advantages."""

    type: Literal["grpo"] = "grpo"
    importance_sampling_level: Literal["token"] = Field("token", description="GRPO's ratios are per token (sequence ratios are rl.objective.type=gspo).")

    @field_validator("surrogate")
    @classmethod
    def _ratio_surrogate(cls, value: str) -> str:
        if value not in SURROGATES:
            raise ValueError(f"{value!r} is not a registered surrogate; one of: {', '.join(SURROGATES)} (the GRPO "
                             "variants are objective types: rl.objective.type=dr_grpo|gspo)")
        if not SURROGATES[value].reads_old_logp:
            raise ValueError(f"{value!r} has no importance ratio; the ratio-free policy gradient is "
                             "rl.objective.type=legacy_pg")
        return value


class DrGRPO(GRPO):
    """Dr-GRPO: GRPO with mean-centred advantages and the fixed divisor `rollout.max_tokens`."""

    type: Literal["dr_grpo"] = "dr_grpo"
    unbiased_advantage: Literal[True] = Field(True, description="Dr-GRPO's advantages are r - mean (fixed by the type).")
    loss_type: Literal["seq-mean-token-sum-fixed"] = Field("seq-mean-token-sum-fixed", description="Dr-GRPO's reduction: the token sum over the fixed divisor rollout.max_tokens (fixed by the type).")


class GSPO(GRPO):
    """GSPO: clipped GRPO with sequence-level ratios, with the paper's clip range and reduction as defaults."""

    type: Literal["gspo"] = "gspo"
    importance_sampling_level: Literal["sequence"] = Field("sequence", description="GSPO's ratio is per sequence (fixed by the type).")
    epsilon_low: float = Field(3e-4, gt=0, lt=1, description="Lower clip range of the sequence ratio (GSPO paper: 3e-4).")
    epsilon_high: float = Field(4e-4, gt=0, description="Upper clip range of the sequence ratio (GSPO paper: 4e-4).")
    lower_bound_ratio: float = Field(0.0, ge=0, description="No dual clip at sequence level: must stay 0.")
    loss_type: str = Field("seq-mean-token-mean", description="Reduction of per-token losses; GSPO's is seq-mean-token-mean.")
    certified_deterministic_forward: bool = Field(True, description="Check that the pi_old pass and the first training forward agree (a sequence ratio is a mean of token log-ratios, so a forward mismatch moves every ratio).")

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        super().check(cfg, err, warn, n_mini)
        if n_mini == 1:
            warn("rl.objective.type=gspo at one update per batch (n_mini=1) is inert: on-policy both ratio levels give "
                 "the same value and gradient; set rl.mini_batch_per_replica to take several updates")
        if max(self.epsilon_low, self.epsilon_high) >= 0.05:
            warn(f"rl.objective.epsilon_low/high={self.epsilon_low}/{self.epsilon_high} are token-scale; sequence "
                 "ratios want ~3e-4/4e-4 (GSPO paper)")
        if self.loss_type != "seq-mean-token-mean":
            warn(f"rl.objective.loss_type={self.loss_type}: a sequence ratio under a token-weighted reduction weights "
                 "sequences by length; GSPO's setting is seq-mean-token-mean")


class LegacyPG(_PolicyGradient):
    """The legacy policy gradient −A·ℓ: on-policy, one update per rollout, no ratio, no clip, no π_old."""

    type: Literal["legacy_pg"] = "legacy_pg"
    surrogate: Literal["legacy_pg"] = Field("legacy_pg", description="The ratio-free surrogate (fixed by the type).")

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        super().check(cfg, err, warn, n_mini)
        if cfg.rollout.temperature != 1.0:
            err(f"rollout.temperature={cfg.rollout.temperature}: rl.objective.type=legacy_pg needs "
                "rollout.temperature=1.0")
        if n_mini > 1:
            err(f"rl.mini_batch_per_replica={cfg.rl.mini_batch_per_replica}: gives {n_mini} updates per batch, but "
                "rl.objective.type=legacy_pg is on-policy only (one update per rollout); remove it or use "
                "rl.objective.type=grpo")
        if cfg.rl.async_steps:
            err(f"rl.async_steps={cfg.rl.async_steps}: a stale batch needs the importance ratio against the rollout's "
                "log-probs, which rl.objective.type=legacy_pg does not have; use rl.objective.type=grpo or "
                "rl.async_steps=0")


GRPO_FAMILY = (GRPO, DrGRPO, GSPO, LegacyPG)


def build_objective(rl, context: ObjectiveContext) -> Objective:
    """The GRPO-family Objective of an `rl` config section whose `objective` is GRPO, Dr-GRPO, GSPO or legacy PG."""
    if not isinstance(rl.objective, GRPO_FAMILY):
        raise ValueError(f"rl.objective.type={rl.objective.type}: not a GRPO-family objective "  # noqa: TRY004 - a config error
                         f"({', '.join(c.model_fields['type'].default for c in GRPO_FAMILY)})")
    return rl.objective.build(rl, context)
