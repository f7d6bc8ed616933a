"""Reward-model training (`rl.objective.type=reward_model`): a Bradley–Terry loss on preference pairs (docs/rewards.md).

The trainer ranks train a sequence-classification model (`AutoModelForSequenceClassification`, one label) built from
`model.name_or_path`: its backbone's weights and a new score head (initialised 0, so every score starts at 0), or
an existing reward model's own head. Nothing is sampled: no rollout engines and no reference.

A row's score `r` is the head's output at the row's last real token (its EOS; the attention mask decides, never
the pad id, which may equal a real token). For a pair (x, y_w, y_l) with scores `r_w`, `r_l`, margin `m =
rl.objective.margin` and centering coefficient `c = rl.objective.center_coef`:

    Δ      = r_w − r_l
    loss   = −log σ(Δ − m) + c · (r_w + r_l)²           per pair
    ∂loss/∂r_w = −σ(m − Δ) + 2c (r_w + r_l),   ∂loss/∂r_l = +σ(m − Δ) + 2c (r_w + r_l)

`Reduction.MEAN` over the pairs of a chunk (the chunk rules are DPO's: equal, even numbers of rows). With the head
at 0 every score is 0 and the loss is `log(1 + e^m)`.

Batch: the pair layout of `rl_core.data.preferences` (rows 2k chosen, 2k+1 rejected). Metrics: `rm_loss` -> `loss`,
`rm_accuracy` -> `accuracy` (fraction of pairs with r_w > r_l, a tie ½), `rm_margin` -> `margin` (mean Δ), `rm_chosen_score`
/ `rm_rejected_score` -> `chosen_score` / `rejected_score`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from rl_core.algorithms.base import ObjectiveConfig, Report
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.dpo import check_pair_chunks
from rl_core.data.preferences import check_pair_layout
from rl_core.primitives.objective import MetricAdapter, Objective, Reduction, scalar_metrics
from rl_core.primitives.scores import HEAD, head_module, sequence_scores

RM_METRIC_NAMES: dict[str, str] = {
    "rm_loss": "loss",
    "rm_accuracy": "accuracy",
    "rm_margin": "margin",
    "rm_chosen_score": "chosen_score",
    "rm_rejected_score": "rejected_score",
}


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: float = 0.0,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss `−log σ(r_w − r_l − m) + c (r_w + r_l)²`. `[P]`, `[P]` -> `[P]`."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss takes two [P] tensors, got {tuple(chosen.shape)} and {tuple(rejected.shape)}")
    loss = F.softplus(-(chosen - rejected - margin))  # = −log σ(Δ − m), stable for large |Δ|
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def reward_model(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                 pad_token_id: int | None = None):
    """The reward model to train from `name_or_path`: a causal LM's backbone with a new score head (0: every score
    starts at 0), or a sequence-classification model with its own head kept. `pad_token_id` fills the config's when it
    has none (transformers' own pooling needs one for batches)."""
    from rl_core.algorithms.value_model import value_model

    model = value_model(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, sequence=True)
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The fraction of pairs ranked right, a tie counting ½ (a model that scores everything alike is at chance, ½)."""
    return ((chosen > rejected).to(torch.float64) + 0.5 * (chosen == rejected).to(torch.float64)).mean()


class BradleyTerryLoss:
    """`fn(model, batch) -> (loss, metrics)` of reward-model training; `Reduction.MEAN` over the chunk's pairs."""

    def __init__(self, margin: float, center_coef: float):
        self.margin, self.center_coef = margin, center_coef

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        check_pair_layout(batch)
        scores = sequence_scores(model, batch.input_ids, batch.attention_mask)
        chosen, rejected = scores[0::2], scores[1::2]
        loss = bradley_terry_loss(chosen, rejected, margin=self.margin, center_coef=self.center_coef).mean()
        with torch.no_grad():
            values = {"rm_loss": loss.detach(), "rm_accuracy": pair_accuracy(chosen, rejected),
                      "rm_margin": (chosen - rejected).mean(), "rm_chosen_score": chosen.mean(),
                      "rm_rejected_score": rejected.mean()}
        return loss, scalar_metrics(values)


class RewardModel(ObjectiveConfig):
    """A reward model trained on fixed (chosen, rejected) pairs with a Bradley–Terry loss (module docstring)."""

    TOPOLOGY: ClassVar = "offline"
    GROUP_RELATIVE: ClassVar[bool] = False
    ROWS_PER_PROMPT: ClassVar[int] = 2  # a chosen and a rejected row per pair
    TRAINS: ClassVar = "reward_model"
    type: Literal["reward_model"] = "reward_model"
    margin: float = Field(0.0, ge=0, description="Margin m of the loss -log sigmoid(r_chosen - r_rejected - m): the score gap below which a pair still has loss.")
    center_coef: float = Field(0.0, ge=0, description="Weight c of c * (r_chosen + r_rejected)^2 in the loss, which keeps the scores centred on 0 (TRL's center_rewards_coefficient; 0: off).")

    @property
    def reads_old_logp(self) -> bool:
        return False

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        check_pair_chunks(cfg, err, "A reward model's")
        if cfg.rl.reference is not None:
            err(f"rl.reference={cfg.rl.reference!r}: rl.objective.type=reward_model reads no reference model; remove it")
        if cfg.rl.async_steps:
            err(f"rl.async_steps={cfg.rl.async_steps}: rl.objective.type=reward_model samples nothing to overlap with; "
                "set it to 0")

    def identity(self, rl: Any, context: ObjectiveContext) -> dict[str, Any]:
        return {
            "objective": "reward_model",
            "loss": "bradley_terry",
            "margin": self.margin,
            "center_coef": self.center_coef,
            "score": "last_real_token",
            "reduction": "mean_over_pairs",
            "policy": dict(context.policy_identity),
        }

    def build(self, rl: Any, context: ObjectiveContext) -> Objective:
        return Objective(
            fn=BradleyTerryLoss(self.margin, self.center_coef),
            reduction=Reduction.MEAN,
            metric_adapter=MetricAdapter(dict(RM_METRIC_NAMES)),
            old_logp_cache=None,
            reference_scorer=None,
            identity=self.identity(rl, context),
        )


__all__ = ["HEAD", "RM_METRIC_NAMES", "BradleyTerryLoss", "RewardModel", "bradley_terry_loss", "head_module", "pair_accuracy",
           "reward_model", "sequence_scores"]
