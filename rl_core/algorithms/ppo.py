"""PPO with a learned critic (`rl.objective.type=ppo`, docs/objectives.md): GAE advantages per token from the
critic's values, the clipped surrogate for the policy, the clipped value loss for the critic.

A step: rollout -> reward -> annotate -> values (the critic, and with `kl_reward_coef` the reference, score the
batch on the trainer ranks) -> `ppo_annotate` (per-token rewards, GAE, whitened advantages, returns) -> validate ->
train (the critic's step on the returns, then the policy's, each with its own optimizer). The critic is
`rl_core.algorithms.value_model` on the policy's architecture (or `critic_model`), trained by an `LLMTrainer` of its
own with `value_objective`; the policy's loss is GRPO's clipped surrogate on per-token advantages.

What a row's return counts: its sequence reward on its last action token, an agent turn's own reward
(`Reply.reward`) on that turn's last token, minus `kl_reward_coef` x the per-token KL (k1, log π_rollout − log π_ref,
the sampler's log-probs against the reference's) on every action token; past its last token nothing, unless the row
was cut by a limit (`bootstrap_truncated`) or is an earlier sample of an agent episode that went on in a new
sample: then the critic's value of its last token stands for what follows (`rl_core.primitives.gae`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from rl_core.algorithms.base import ClipKnobs, KLKnobs, LossTypeKnob, Report
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.grpo import policy_gradient_objective
from rl_core.primitives.gae import clipped_value_loss, gae, masked_whiten, token_rewards
from rl_core.primitives.objective import (
    OBJECTIVE_WEIGHT_SUM,
    MetricAdapter,
    Objective,
    Reduction,
    scalar_metrics,
)
from rl_core.primitives.policy_gradient import reduce_policy_gradient_loss


class PPO(LossTypeKnob, KLKnobs, ClipKnobs):
    """PPO with a critic: per-token GAE advantages, the clipped surrogate, a value model trained beside the policy."""

    type: Literal["ppo"] = "ppo"
    GROUP_RELATIVE = False  # the critic is the baseline: one completion per prompt is enough
    importance_sampling_level: Literal["token"] = Field("token", description="PPO's ratios are per token.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount γ per action token.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's λ: 1 is the Monte-Carlo return minus the value, 0 the one-step TD error.")
    value_clip: float = Field(0.5, gt=0, description="The value loss's clip c: the critic's new value counts at most c away from its value at collection (verl's cliprange_value).")
    value_loss_coef: float = Field(1.0, gt=0, description="Scale of the critic's loss (its own optimizer: under AdamW it matters through rl.optimizer.max_grad_norm).")
    critic_lr: float = Field(1e-5, gt=0, description="The critic's AdamW learning rate (its other optimizer settings are rl.optimizer's).")
    critic_warmup_steps: int = Field(0, ge=0, description="Steps in which only the critic trains: the policy's weights stay as they are.")
    critic_model: str | None = Field(None, description="The critic's backbone, a hub id or a local path sharing the policy's tokenizer; None: the policy's model.")
    critic_head_std: float = Field(0.0, ge=0, description="The value head's initial weights N(0, std²); 0: every value starts at 0.")
    kl_reward_coef: float = Field(0.0, ge=0, description="β of the KL penalty in the reward: −β·(log π_rollout − log π_ref) on every action token (verl's use_kl_in_reward); 0 disables it.")
    bootstrap_truncated: bool = Field(True, description="A row cut by a limit (rollout.max_tokens, max_turns, max_episode_tokens) bootstraps its return with the critic's value of its last token instead of ending there.")

    @property
    def reads_reference(self) -> bool:
        return self.kl_beta > 0 or self.kl_reward_coef > 0

    @property
    def has_critic(self) -> bool:
        return True

    def identity(self, rl: Any, context: ObjectiveContext) -> dict[str, Any]:
        ident: dict[str, Any] = {"objective": "ppo", "epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high,
                                 "lower_bound_ratio": self.lower_bound_ratio, **self.correction_identity(),
                                 "loss_type": self.loss_type, "temperature": context.temperature,
                                 "fixed_divisor": context.max_response_length
                                 if self.loss_type == "seq-mean-token-sum-fixed" else None,
                                 "gamma": self.gamma, "lam": self.lam, "value_clip": self.value_clip,
                                 "value_loss_coef": self.value_loss_coef, "critic_lr": self.critic_lr,
                                 "critic_warmup_steps": self.critic_warmup_steps, "critic_model": self.critic_model,
                                 "critic_head_std": self.critic_head_std, "bootstrap_truncated": self.bootstrap_truncated,
                                 "kl_beta": self.kl_beta, "kl_reward_coef": self.kl_reward_coef}
        if self.kl_beta > 0:
            ident["kl_estimator"] = self.kl_estimator
        if self.reads_reference:
            ident["reference"] = rl.reference
        ident["policy"] = dict(context.policy_identity)
        return ident

    def build(self, rl: Any, context: ObjectiveContext) -> Objective:
        """The policy's Objective: GRPO's clipped surrogate on the per-token advantages `ppo_annotate` sets."""
        return policy_gradient_objective(self, context, self.identity(rl, context))

    @property
    def surrogate(self) -> str:
        return "clipped"  # what GRPOLoss reads

    def check(self, cfg: Any, err: Report, warn: Report, n_mini: int) -> None:
        super().check(cfg, err, warn, n_mini)
        if self.critic_model is not None and cfg.cluster.sharding != "none":
            err(f"rl.objective.critic_model={self.critic_model!r} with cluster.sharding={cfg.cluster.sharding}: a "
                "sharded critic is built from the policy's model; remove critic_model or set cluster.sharding=none")


def value_objective(ppo: PPO, context: ObjectiveContext) -> Objective:
    """The critic's Objective (`Reduction.TOKEN_SUM`): `value_loss_coef` x PPO's clipped value loss against
    `batch.returns`, clipped around `batch.old_values`, reduced by `loss_type` over the loss tokens. It stays valid
    over several optimizer steps on one batch (the clip is against the values at collection), so the critic
    takes the policy's mini-batches."""
    return Objective(fn=ValueLoss(ppo.value_clip, ppo.value_loss_coef, ppo.loss_type, context.max_response_length),
                     reduction=Reduction.TOKEN_SUM,
                     # critic/loss (the trainer's own) is the value loss
                     metric_adapter=MetricAdapter({"vf_clip_frac": "value_clip_frac", "vpred_mean": "vpred_mean"},
                                                  ignored=frozenset({"vf_loss"})),
                     identity={"objective": "ppo_critic", "value_clip": ppo.value_clip,
                               "value_loss_coef": ppo.value_loss_coef, "loss_type": ppo.loss_type},
                     multiple_updates=True)


class ValueLoss:
    """`fn(critic, batch) -> (loss, metrics)` of the critic (`value_objective`)."""

    def __init__(self, clip: float, coef: float, loss_type: str, max_response_length: int):
        self.clip, self.coef, self.loss_type, self.max_response_length = clip, coef, loss_type, max_response_length

    def __call__(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from rl_core.algorithms.value_model import token_values

        for name in ("old_values", "returns"):
            if getattr(batch, name) is None:
                raise ValueError(f"batch.{name} is missing: the critic trains on a batch annotated by "
                                 "rl_core.algorithms.ppo.ppo_annotate")
        values = token_values(model, batch.input_ids, batch.attention_mask)
        mask = batch.loss_mask.to(values.dtype)
        per_token, clipped = clipped_value_loss(values, batch.old_values.to(values.dtype),
                                                batch.returns.to(values.dtype), mask, self.clip)
        numerator, weight = reduce_policy_gradient_loss(per_token * self.coef, mask, self.loss_type,
                                                        max_response_length=self.max_response_length)
        denom = torch.where(weight > 0, weight, torch.ones_like(weight))
        loss = numerator / denom
        tokens = mask.sum().clamp_min(1)
        metrics = scalar_metrics({"vf_loss": loss.detach(), "vf_clip_frac": clipped,
                                  "vpred_mean": (values.detach() * mask).sum() / tokens})
        metrics[OBJECTIVE_WEIGHT_SUM] = weight.detach()
        return loss, metrics


def ppo_annotate(batch, table, values: torch.Tensor, ppo: PPO, ref_logp: torch.Tensor | None = None
                 ) -> tuple[Any, Any, dict[str, float]]:
    """The batch with PPO's `advantages [B, T]` (GAE, whitened over the batch's loss tokens), `returns [B, T]` and
    `old_values [B, T]` (the critic's `values` at collection); the annotations table with each row's mean advantage
    over its loss tokens; and the step's `critic/...` stats (module docstring for what a return counts).

    `table` is `rl_core.annotate`'s: its `sample_of` tells an agent episode's earlier samples (their reward is the
    episode's last sample's, so it is on that row alone, and their returns bootstrap) and `truncated` the rows a
    limit cut. `ref_logp [B, T]`: the reference's log-probs, needed with `kl_reward_coef` > 0."""
    mask = batch.loss_mask.float()
    if tuple(values.shape) != tuple(mask.shape):
        raise ValueError(f"critic values {list(values.shape)} do not match the batch {list(mask.shape)}")
    values = values.float() * mask
    own, of = torch.tensor(table["sample_id"].to_numpy()), torch.tensor(table["sample_of"].to_numpy())
    earlier = (of != own) & (of >= 0)
    cut = torch.tensor(table["truncated"].to_numpy(), dtype=torch.bool) & ppo.bootstrap_truncated
    scores = torch.where(earlier, torch.zeros_like(batch.rewards.float()), batch.rewards.float())
    kl = None
    if ppo.kl_reward_coef > 0:
        if ref_logp is None:
            raise ValueError("rl.objective.kl_reward_coef > 0 needs the reference's log-probs of the batch")
        kl = (batch.rollout_logp.float() - ref_logp.float()) * mask
    rewards = token_rewards(scores, mask, kl=kl, kl_coef=ppo.kl_reward_coef)
    if batch.turn_rewards is not None:  # an agent turn's own reward, on its last token (Reply.reward)
        rewards = rewards + batch.turn_rewards.float() * mask
    advantages, returns = gae(rewards, values, mask, gamma=ppo.gamma, lam=ppo.lam, bootstrap=earlier | cut)
    whitened = masked_whiten(advantages, mask) * mask
    row_tokens = mask.sum(1)
    table = table.assign(advantage=((whitened.sum(1) / row_tokens.clamp_min(1)).double().numpy()))
    on = mask > 0
    residual = (returns - values)[on]
    stats = {"critic/values_mean": float(values[on].mean()), "critic/returns_mean": float(returns[on].mean()),
             "critic/advantages_raw_mean": float(advantages[on].mean()),
             "critic/explained_variance": float(1 - residual.var() / returns[on].var().clamp_min(1e-8))}
    if kl is not None:
        stats["rollout/kl_reward"] = float(kl[on].mean())
    batch = batch.replace(advantages=whitened, returns=returns * mask, old_values=values,
                          ref_logp=None if ref_logp is None else ref_logp.float() * mask)
    return batch, table, stats
