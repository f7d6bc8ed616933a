"""GRPO-family objective (GRPO, Dr-GRPO, GSPO, legacy PG): config -> Objective (docs/objectives.md).

Everything is selected from `rl` alone: the surrogate (`grpo_surrogate`), the ratio level
(`importance_sampling_level`), the reduction (`loss_type`, fixed divisor from the context) and the
KL anchor (`kl_beta`, `kl_estimator`). Dr-GRPO and GSPO are configurations of this builder, not code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.surrogates import loss_and_metrics, metric_names, surrogate
from rl_core.primitives.kl import kl_penalty
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import (
    LogprobScorer,
    MetricAdapter,
    Objective,
    OldLogpCache,
    Reduction,
)
from rl_core.primitives.policy_gradient import (
    clip_settings_problem,
    reduce_policy_gradient_loss,
)

# algorithm-local name -> public suffix (published as train/<suffix>)
GRPO_METRIC_NAMES: dict[str, str] = metric_names("grpo", "kl")


@dataclass(frozen=True)
class GRPOSettings:
    grpo_surrogate: str
    importance_sampling_level: str
    epsilon_low: float
    epsilon_high: float
    lower_bound_ratio: float
    loss_type: str
    max_response_length: int
    temperature: float
    kl_beta: float
    kl_estimator: str


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

    def __init__(self, settings: GRPOSettings, old_logp_cache: OldLogpCache | None):
        self.settings = settings
        self.old_logp_cache = old_logp_cache

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.settings
        chosen = surrogate(s.grpo_surrogate)
        adv = _require(batch.advantages, "advantages",
                       "annotate the batch with group advantages (rl_core.annotators) before training")
        if chosen.reads_old_logp and s.importance_sampling_level == "sequence" and adv.dim() != 1:
            raise ValueError("batch.advantages are per token ([B, T]) but rl.importance_sampling_level=sequence needs one "
                             "advantage per completion ([B]); use rl.importance_sampling_level=token")
        logp, entropy = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                temperature=s.temperature, return_entropy=True,
                                                loss_mask=batch.loss_mask)
        entropy = entropy.detach()
        mask = batch.loss_mask.to(logp.dtype)

        old = None
        if chosen.reads_old_logp:
            if self.old_logp_cache is None:
                old = _require(batch.old_logp, "old_logp", f"rl.grpo_surrogate={s.grpo_surrogate} needs pi_old log-probs")
            else:
                old = self.old_logp_cache.lookup(batch.sample_ids, batch.policy_version, logp)
        per_token, stats = chosen.fn(logp, old, adv, mask, s)
        pg_num, weight = reduce_policy_gradient_loss(per_token, mask, s.loss_type,
                                                     max_response_length=s.max_response_length)
        numerator, own = pg_num, {}
        if s.kl_beta > 0:
            ref = _require(batch.ref_logp, "ref_logp", "rl.kl_beta > 0 needs reference log-probs; pass the reference "
                           "model to the trainer as auxiliary_models={'reference': model}")
            own["kl"], _ = reduce_policy_gradient_loss(kl_penalty(logp, ref, s.kl_estimator), mask, s.loss_type,
                                                       max_response_length=s.max_response_length)
            numerator = pg_num + s.kl_beta * own["kl"]
        loss, metrics = loss_and_metrics("grpo", numerator, weight, pg_numerator=pg_num, stats=stats, logp=logp,
                                         rollout_logp=batch.rollout_logp, entropy=entropy, advantages=adv, mask=mask,
                                         own=own)
        return loss, metrics


def grpo_identity(rl, context: ObjectiveContext) -> dict[str, Any]:
    """Every value that changes the math of this objective (docs/objectives.md), as plain data."""
    ident: dict[str, Any] = {"objective": "grpo", "grpo_surrogate": rl.grpo_surrogate}
    if rl.grpo_surrogate == "clipped":
        ident.update(importance_sampling_level=rl.importance_sampling_level, epsilon_low=rl.epsilon_low,
                     epsilon_high=rl.epsilon_high, lower_bound_ratio=rl.lower_bound_ratio)
    ident["loss_type"] = rl.loss_type
    ident["fixed_divisor"] = context.max_response_length if rl.loss_type == "seq-mean-token-sum-fixed" else None
    ident["temperature"] = rl.temperature
    ident["kl_beta"] = rl.kl_beta
    if rl.kl_beta > 0:
        ident.update(kl_estimator=rl.kl_estimator, reference=rl.reference)
    ident["unbiased_advantage"] = rl.unbiased_advantage
    if not rl.unbiased_advantage:
        ident["advantage_eps"] = rl.advantage_eps
    ident["shared_prefix_min_tokens"] = rl.shared_prefix_min_tokens
    ident["policy"] = dict(context.policy_identity)
    return ident


def build_objective(rl, context: ObjectiveContext) -> Objective:
    """GRPO / Dr-GRPO / GSPO / legacy PG from the `rl` config section (an `RLConfig`) and the context."""
    clipped = surrogate(rl.grpo_surrogate).reads_old_logp  # raises naming the registered surrogates
    if clipped and (problem := clip_settings_problem(rl.lower_bound_ratio, rl.importance_sampling_level, "rl.")):
        raise ValueError(problem)
    if not clipped and rl.importance_sampling_level != "token":
        raise ValueError("rl.importance_sampling_level=sequence is a knob of rl.grpo_surrogate=clipped; legacy_pg has "
                         "no ratio")
    settings = GRPOSettings(
        grpo_surrogate=rl.grpo_surrogate,
        importance_sampling_level=rl.importance_sampling_level,
        epsilon_low=rl.epsilon_low,
        epsilon_high=rl.epsilon_high,
        lower_bound_ratio=rl.lower_bound_ratio,
        loss_type=rl.loss_type,
        max_response_length=context.max_response_length,
        temperature=rl.temperature,
        kl_beta=rl.kl_beta,
        kl_estimator=rl.kl_estimator,
    )
    cache = None
    if clipped:
        cache = OldLogpCache(LogprobScorer(rl.temperature),
                             certified_deterministic_forward=rl.certified_deterministic_forward,
                             accelerator_atol=rl.certified_forward_atol)
    return Objective(
        fn=GRPOLoss(settings, cache),
        reduction=Reduction.TOKEN_SUM,
        metric_adapter=MetricAdapter(dict(GRPO_METRIC_NAMES)),
        old_logp_cache=cache,
        reference_scorer=LogprobScorer(rl.temperature) if rl.kl_beta > 0 else None,
        identity=grpo_identity(rl, context),
    )
