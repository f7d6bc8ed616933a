"""The annotate phase: from scored completions to the training batch and its annotations table.

Runs while whole groups are present (docs/objectives.md): group advantages, the shared-prefix mask, and the
one-row-per-completion table that the pandera gate checks before anything reaches a trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from rl_core.agents.rollout import episode_stats
from rl_core.annotators.advantage import group_advantages
from rl_core.annotators.shared_prefix import shared_prefix_loss_mask
from rl_core.batch.trajectory import Trajectory
from rl_core.config import RLConfig


@dataclass
class Annotated:
    batch: Trajectory
    table: pd.DataFrame
    stats: dict[str, float]
    sampled: torch.Tensor | None = None  # [B, T] bool: the tokens the engine sampled (the gate bounds the loss by it)


def annotate(
    completions,
    rewards: Sequence[float],
    prompt_ids: Sequence[int],
    *,
    rl: RLConfig,
    first_sample_id: int,
    padding: Sequence[int] = (),
) -> Annotated:
    """Build the Trajectory and annotations table of one step.

    `completions`: the engine's output (rows of prompt i contiguous, `prompt_index` giving i);
    `prompt_ids[i]`: the dataset row of input prompt i; `first_sample_id`: sample ids are
    `first_sample_id + row`, unique across the run; `padding`: the groups (prompt indices) that only fill the
    batch's shape (dynamic sampling's fallback, `rl_core.batch.dynamic_sampling`): their rows are left out of the
    loss and their advantages are 0.
    """
    n_rows = completions.input_ids.shape[0]
    if len(rewards) != n_rows:
        raise ValueError(f"annotate: {len(rewards)} rewards for {n_rows} completions")
    reward_t = torch.tensor([float(r) for r in rewards], dtype=torch.float32)
    group_ids = torch.as_tensor(completions.prompt_index, dtype=torch.long)
    # A non-finite reward is the gate's to refuse (naming the rows): its group gets NaN advantages.
    finite = torch.isfinite(reward_t)
    knobs = rl.objective  # the group-advantage knobs of the objective
    advantages = group_advantages(torch.where(finite, reward_t, 0.0), group_ids, unbiased=knobs.unbiased_advantage,
                                  eps=knobs.advantage_eps).float()
    if not bool(finite.all()):
        poisoned = torch.isin(group_ids, group_ids[~finite])
        advantages = torch.where(poisoned, torch.full_like(advantages, float("nan")), advantages)
    loss_mask = completions.response_mask.float()
    if knobs.shared_prefix_min_tokens > 0:
        loss_mask = shared_prefix_loss_mask(completions.input_ids, loss_mask, reward_t, group_ids,
                                            knobs.shared_prefix_min_tokens)
    prefix_masked = float(1 - loss_mask.sum() / completions.response_mask.float().sum().clamp_min(1))
    truncated = torch.tensor([reason != "stop" for reason in completions.finish_reason], dtype=torch.bool)
    if knobs.mask_truncated:  # cut by a limit: out of the loss, its reward still in its group's advantages
        loss_mask = loss_mask * (~truncated).float().unsqueeze(1)
    if len(padding):  # in the batch for its shape only: weight 0 in every reduction
        filler = torch.isin(group_ids, torch.as_tensor(list(padding), dtype=torch.long))
        loss_mask = loss_mask * (~filler).float().unsqueeze(1)
        advantages = torch.where(filler, torch.zeros_like(advantages), advantages)
    sample_ids = torch.arange(first_sample_id, first_sample_id + n_rows, dtype=torch.long)
    batch = Trajectory(
        input_ids=completions.input_ids,
        attention_mask=completions.attention_mask,
        loss_mask=loss_mask,
        rollout_logp=completions.sampling_logp.float() * loss_mask,
        rewards=reward_t,
        group_ids=group_ids,
        sample_ids=sample_ids,
        policy_version=int(completions.policy_version),
        advantages=advantages,
        routes=completions.routes,
    )
    response_len = completions.response_mask.sum(1).round().long()
    group_size = torch.bincount(group_ids)[group_ids]
    table = pd.DataFrame({
        "sample_id": sample_ids.numpy().astype("int64"),
        "prompt_id": [int(prompt_ids[g]) for g in group_ids.tolist()],
        "group_id": group_ids.numpy().astype("int64"),
        "group_size": group_size.numpy().astype("int64"),
        "reward": reward_t.double().numpy(),
        "advantage": advantages.double().numpy(),
        "response_len": response_len.numpy().astype("int64"),
        "truncated": truncated.tolist(),
        "masked_len": (completions.response_mask.sum(1) - loss_mask.sum(1)).round().long().numpy().astype("int64"),
        # an agent episode that could not start (rl_core.agents.Episode.unstarted): no response, no loss token
        "started": [bool(e["stats"].get("started", True)) for e in completions.episodes] if completions.episodes
        is not None else [True] * n_rows,
        "policy_version": [int(completions.policy_version)] * n_rows,
    })
    per_group = table.groupby("group_id")["reward"].agg(["min", "max"])
    stats = {
        "rollout/reward_mean": float(reward_t.mean()),
        "rollout/reward_std": float(reward_t.std(unbiased=False)) if n_rows > 1 else 0.0,
        "rollout/response_len_mean": float(response_len.float().mean()),
        "rollout/response_len_max": float(response_len.max()),
        "rollout/truncation_rate": float(table["truncated"].mean()),
        "rollout/zero_adv_group_frac": float((per_group["min"] == per_group["max"]).mean()),
        "rollout/masked_prefix_frac": prefix_masked,
    }
    if completions.routes is not None:  # what routing replay adds to the batch (model.routing_replay=rollout)
        stats["rollout/routes_mb"] = completions.routes.numel() * completions.routes.element_size() / 2**20
    if completions.episodes is not None:
        stats.update(episode_stats(completions.episodes))
    return Annotated(batch=batch, table=table, stats=stats, sampled=completions.response_mask > 0)
