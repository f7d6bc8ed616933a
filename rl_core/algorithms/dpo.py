"""Direct preference optimisation (DPO): config -> Objective (docs/objectives.md).

Offline: no rollout, no reward, no π_old. For a pair (x, y_w, y_l) with sequence log-probs
`ℓ_w = Σ_t M ℓ_t` of the chosen and `ℓ_l` of the rejected response (sum over response tokens and
EOS, at `T = rollout.temperature`), and the same under the frozen reference, `β = rl.objective.beta`:

    h      = β [(ℓ_w − ℓ^ref_w) − (ℓ_l − ℓ^ref_l)]        (the margin of implicit rewards)
    loss   = −log σ(h) = softplus(−h)                      per pair
    ∂loss/∂ℓ_w = −β σ(−h),   ∂loss/∂ℓ_l = +β σ(−h)

`Reduction.MEAN` over the pairs of a chunk; the trainer divides by the number of chunks, so chunks
must hold equal numbers of pairs (even, equal numbers of rows). With policy == reference, `h = 0`
and the loss is `log 2` exactly.

Batch: the `Trajectory` pair layout of `rl_core.data.preferences` (rows 2k chosen, 2k+1 rejected,
`group_ids` = pair id). The reference is scored once, before training, without grad, and travels
with the batch as `ref_logp [B, T]` (`with_reference_logps(ref_model, batch)`; select pairs of the
scored dataset with `pair_rows` so every step reuses the cached values). The objective has no
`reference_scorer`: a batch without `ref_logp` is refused instead of being re-scored each step.

Metrics (local -> `train/…`, `val/…` through `evaluate_pairs`): `dpo_loss` -> `loss`,
`dpo_reward_accuracy` -> `reward_accuracy` (fraction of pairs with h > 0), `dpo_margin` ->
`margin` (mean h), `dpo_chosen_reward` / `dpo_rejected_reward` -> `chosen_reward` /
`rejected_reward` (means of β(ℓ − ℓ^ref)), `dpo_chosen_logp` / `dpo_rejected_logp` -> `chosen_logp`
/ `rejected_logp` (mean sequence log-probs under the policy).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from rl_core.algorithms.base import ObjectiveConfig, Report
from rl_core.algorithms.context import ObjectiveContext
from rl_core.data.preferences import check_pair_layout, pair_rows
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import (
    MetricAdapter,
    Objective,
    Reduction,
    frozen_token_logprobs,
    scalar_metrics,
)

DPO_METRIC_NAMES: dict[str, str] = {
    "dpo_loss": "loss",
    "dpo_reward_accuracy": "reward_accuracy",
    "dpo_margin": "margin",
    "dpo_chosen_reward": "chosen_reward",
    "dpo_rejected_reward": "rejected_reward",
    "dpo_chosen_logp": "chosen_logp",
    "dpo_rejected_logp": "rejected_logp",
}

__all__ = [
    "DPO", "DPO_METRIC_NAMES", "DPOLoss", "build_objective", "check_pair_chunks", "dpo_loss", "evaluate_pairs", "pair_rows",
    "reference_sequence_logps", "reference_token_logps", "sequence_logps", "with_reference_logps",
]


def sequence_logps(token_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`Σ_t M_{i,t} ℓ_{i,t}` per row. `[B, T]` -> `[B]`; masked positions never contribute."""
    if loss_mask.shape != token_logp.shape:
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}; expected {tuple(token_logp.shape)}")
    m = loss_mask.to(token_logp.dtype)
    return torch.where(m > 0, token_logp * m, torch.zeros_like(token_logp)).sum(-1)


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, *, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO loss `−log σ(β[(ℓ_w − ℓ^ref_w) − (ℓ_l − ℓ^ref_l)])`. All `[P]` -> `([P], parts)`.

    `parts` (detached `[P]`): `margin` h, `chosen_reward` β(ℓ_w − ℓ^ref_w), `rejected_reward`
    β(ℓ_l − ℓ^ref_l). Gradients flow through the policy terms only (the reference is detached).
    """
    if not beta > 0:
        raise ValueError(f"beta={beta}: must be > 0 (rl.objective.beta)")
    shapes = {tuple(t.shape) for t in (chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"dpo_loss takes four [P] tensors, got shapes {sorted(shapes)}")
    chosen_reward = beta * (chosen_logp - ref_chosen_logp.detach().to(chosen_logp.dtype))
    rejected_reward = beta * (rejected_logp - ref_rejected_logp.detach().to(rejected_logp.dtype))
    margin = chosen_reward - rejected_reward
    loss = F.softplus(-margin)  # = −log σ(margin), stable for large |margin|
    return loss, {"margin": margin.detach(), "chosen_reward": chosen_reward.detach(),
                  "rejected_reward": rejected_reward.detach()}


# --------------------------------------------------------------------------------------- reference


def reference_token_logps(ref_model: torch.nn.Module, batch, *, temperature: float = 1.0,
                          micro_batch_size: int | None = None) -> torch.Tensor:
    """Reference per-token log-probs `[B, T]` float32 of a pair batch, 0 off the loss mask, without grad.

    Same primitive as the training forward (`frozen_token_logprobs`), in chunks of `micro_batch_size` rows.
    """
    return frozen_token_logprobs(ref_model, batch, temperature=temperature, micro_batch_size=micro_batch_size)


def with_reference_logps(ref_model: torch.nn.Module, batch, *, temperature: float = 1.0,
                         micro_batch_size: int | None = None):
    """The pair batch with `ref_logp` filled: call once per dataset (train and held-out) before training."""
    check_pair_layout(batch)
    return batch.replace(ref_logp=reference_token_logps(ref_model, batch, temperature=temperature,
                                                        micro_batch_size=micro_batch_size))


def reference_sequence_logps(ref_model: torch.nn.Module, batch, temperature: float = 1.0, *,
                             micro_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ref_chosen_logp [P], ref_rejected_logp [P])`: the reference's sequence log-probs of each pair.

    Uses `batch.ref_logp` when present (the cache), else scores the batch.
    """
    check_pair_layout(batch)
    token = batch.ref_logp if batch.ref_logp is not None else reference_token_logps(
        ref_model, batch, temperature=temperature, micro_batch_size=micro_batch_size)
    seq = sequence_logps(token, batch.loss_mask)
    return seq[0::2], seq[1::2]


# --------------------------------------------------------------------------------------- objective


class DPOLoss:
    """`fn(model, batch) -> (loss, metrics)` of DPO; `Reduction.MEAN` (mean over the chunk's pairs)."""

    def __init__(self, beta: float, temperature: float):
        self.beta, self.temperature = beta, temperature

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        s = self
        check_pair_layout(batch)
        if batch.ref_logp is None:
            raise ValueError("batch.ref_logp is missing: DPO scores the reference once, before training; build the "
                             "batch with rl_core.algorithms.dpo.with_reference_logps(ref_model, batch, temperature=...)")
        logp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=s.temperature,
                                       loss_mask=batch.loss_mask)
        seq = sequence_logps(logp, batch.loss_mask)
        ref = sequence_logps(batch.ref_logp.to(logp.dtype), batch.loss_mask)
        per_pair, parts = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=s.beta)
        loss = per_pair.mean()
        with torch.no_grad():
            values = {
                "dpo_loss": loss.detach(),
                "dpo_reward_accuracy": (parts["margin"] > 0).to(torch.float64).mean(),
                "dpo_margin": parts["margin"].mean(),
                "dpo_chosen_reward": parts["chosen_reward"].mean(),
                "dpo_rejected_reward": parts["rejected_reward"].mean(),
                "dpo_chosen_logp": seq[0::2].detach().mean(),
                "dpo_rejected_logp": seq[1::2].detach().mean(),
            }
        return loss, scalar_metrics(values)


def evaluate_pairs(objective: Objective, model: torch.nn.Module, batch, *, micro_batch_size: int | None = None,
                   split: str = "val") -> dict[str, float]:
    """Held-out DPO metrics (`val/loss`, `val/reward_accuracy`, ...): the objective without grad, pair-weighted.

    `batch` must carry `ref_logp` (`with_reference_logps`); chunks may be unequal (each chunk's
    means are weighted by its number of pairs). The model's train/eval mode is restored.
    """
    check_pair_layout(batch)
    if micro_batch_size is not None and micro_batch_size % 2:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be an even number of rows (whole pairs)")
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    pairs = 0
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            for chunk in (batch.split(micro_batch_size) if micro_batch_size else [batch]):
                _, metrics = objective.fn(model, chunk.to(device))
                n = chunk.batch_size // 2
                pairs += n
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * n
    finally:
        model.train(was_training)
    return objective.metric_adapter.publish({k: v / pairs for k, v in sums.items()}, split)


def check_pair_chunks(cfg: Any, err: Report, what: str) -> None:
    """The rules of an objective trained on (chosen, rejected) row pairs with a mean over each chunk's pairs (DPO, a
    reward model): chunks of whole, equal numbers of pairs, whole pairs per rank, and nothing sampled to bound."""
    rl, ro, kind = cfg.rl, cfg.rollout, cfg.rl.objective.type
    for key, value in (("micro_batch_per_replica", rl.micro_batch_per_replica),
                       ("mini_batch_per_replica", rl.mini_batch_per_replica)):
        if value is not None and value % 2:
            err(f"rl.{key}={value}: {what} rows come in (chosen, rejected) pairs, so a {key.split('_')[0]}-batch must "
                "hold an even number of rows")
    if rl.micro_batch_max_tokens is not None:
        err(f"rl.micro_batch_max_tokens={rl.micro_batch_max_tokens}: {what}'s loss is a mean over the pairs of a "
            "chunk (Reduction.MEAN), so its chunks must hold equal numbers of pairs; use rl.micro_batch_per_replica")
    if ro.max_logp_abs_diff is not None:
        err(f"rollout.max_logp_abs_diff={ro.max_logp_abs_diff:g}: rl.objective.type={kind} samples nothing, so there "
            "is no sampler-vs-trainer log-prob gap to bound; remove it")
    if ro.prompts_per_step % cfg.cluster.num_workers:
        err(f"rollout.prompts_per_step={ro.prompts_per_step} ({what}: pairs per step) does not split into whole pairs "
            f"across cluster.num_workers={cfg.cluster.num_workers}")


class DPO(ObjectiveConfig):
    """DPO on fixed (chosen, rejected) pairs against a frozen reference (`rl.reference`, or the initial policy)."""

    TOPOLOGY: ClassVar = "offline"
    GROUP_RELATIVE: ClassVar[bool] = False
    ROWS_PER_PROMPT: ClassVar[int] = 2  # a chosen and a rejected row per pair
    type: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0, description="Beta of the implicit reward beta * (logp - ref_logp) of a response.")

    @property
    def reads_old_logp(self) -> bool:
        return False

    @property
    def reads_reference(self) -> bool:
        return True

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        check_pair_chunks(cfg, err, "DPO")

    def identity(self, rl: Any, context: ObjectiveContext) -> dict[str, Any]:
        return {
            "objective": "dpo",
            "dpo_beta": self.beta,
            "temperature": context.temperature,
            "reference": rl.reference,  # None: the frozen initial policy
            "sequence_logp": "sum",
            "reduction": "mean_over_pairs",
            "policy": dict(context.policy_identity),
        }

    def build(self, rl: Any, context: ObjectiveContext) -> Objective:
        """Reads `beta` and `rollout.temperature` (`context.temperature`); `rl.reference` names the model that `with_reference_logps` must be
        given."""
        return Objective(
            fn=DPOLoss(self.beta, context.temperature),
            reduction=Reduction.MEAN,
            metric_adapter=MetricAdapter(dict(DPO_METRIC_NAMES)),
            old_logp_cache=None,
            reference_scorer=None,
            identity=self.identity(rl, context),
        )


def build_objective(rl, context: ObjectiveContext) -> Objective:
    """The DPO Objective of an `rl` config section whose `objective` is a `DPO`."""
    if not isinstance(rl.objective, DPO):
        raise ValueError(f"rl.objective.type={rl.objective.type}: not a DPO objective (rl.objective.type=dpo)")  # noqa: TRY004 - a config error
    return rl.objective.build(rl, context)
