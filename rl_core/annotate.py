"""The annotate phase: from scored completions to the training batch and its annotations table.

Runs while whole groups are present (docs/objectives.md): group advantages, the shared-prefix mask, and the
one-row-per-completion table that the pandera gate checks before anything reaches a trainer.

An agent episode that started new samples (`Completions.earlier_samples`, `rl_core.agents.episode`) is one row per
sample: its group's advantages are taken over the episodes (one reward each), and every sample of an episode
carries the episode's reward and advantage. The table's `sample_of` names the episode row a row belongs to (its
own `sample_id` for an episode's row). Rows after them fill the batch to a multiple of `row_multiple` (the rows
the ranks, mini- and micro-batches split evenly, `rl_core.placement.run_shape.batch_row_multiple`): copies of the
last row out of the loss, advantage 0, `sample_of` -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pandas as pd
import torch

from rl_core.agents.rollout import episode_stats
from rl_core.algorithms.base import GroupAdvantageKnobs
from rl_core.annotators.advantage import group_advantages
from rl_core.annotators.shared_prefix import shared_prefix_loss_mask
from rl_core.batch.trajectory import Trajectory
from rl_core.config import RLConfig
from rl_core.rollout.completions import concat_completions


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
    row_multiple: int = 1,
) -> Annotated:
    """Build the Trajectory and annotations table of one step.

    `completions`: the engine's output (rows of prompt i contiguous, `prompt_index` giving i);
    `prompt_ids[i]`: the dataset row of input prompt i; `first_sample_id`: sample ids are
    `first_sample_id + row`, unique across the run; `padding`: the groups (prompt indices) that only fill the
    batch's shape (dynamic sampling's fallback, `rl_core.batch.dynamic_sampling`): their rows are left out of the
    loss and their advantages are 0; `row_multiple`: the batch's rows are filled to a multiple of it (module
    docstring).
    """
    episodes = completions.input_ids.shape[0]
    if len(rewards) != episodes:
        raise ValueError(f"annotate: {len(rewards)} rewards for {episodes} completions")
    reward_t = torch.tensor([float(r) for r in rewards], dtype=torch.float32)
    group_ids = torch.as_tensor(completions.prompt_index, dtype=torch.long)
    # A non-finite reward is the gate's to refuse (naming the rows): its group gets NaN advantages.
    finite = torch.isfinite(reward_t)
    knobs = rl.objective  # the group-advantage knobs of the objective; PPO has none (its critic's phase sets them)
    grouped = isinstance(knobs, GroupAdvantageKnobs)
    advantages = group_advantages(torch.where(finite, reward_t, 0.0), group_ids, unbiased=knobs.unbiased_advantage,
                                  eps=knobs.advantage_eps).float() if grouped else torch.zeros(episodes)
    if not bool(finite.all()):
        poisoned = torch.isin(group_ids, group_ids[~finite])
        advantages = torch.where(poisoned, torch.full_like(advantages, float("nan")), advantages)
    records = completions.episodes  # one per episode row; the joined completions below have none
    started = [bool(e["stats"].get("started", True)) for e in records] if records is not None else [True] * episodes
    # every row of the batch: the episodes' rows, their earlier samples (each its episode's), the filler
    extra = completions.earlier_samples
    owner = torch.arange(episodes) if extra is None else torch.cat([torch.arange(episodes), extra.prompt_index])
    if extra is not None:
        completions = concat_completions([replace(completions, earlier_samples=None), extra], index_offsets=[0, 0])
    fill = -len(owner) % row_multiple
    owner = torch.cat([owner, owner[-1:].repeat(fill)])
    reward_t, group_ids, advantages = reward_t[owner], group_ids[owner], advantages[owner]
    filler = torch.arange(len(owner)) >= len(owner) - fill
    if fill:
        completions = completions.rows([*range(len(completions)), *[len(completions) - 1] * fill])
    n_rows = len(owner)
    loss_mask = completions.response_mask.float()
    if grouped and knobs.shared_prefix_min_tokens > 0:
        loss_mask = shared_prefix_loss_mask(completions.input_ids, loss_mask, reward_t, group_ids,
                                            knobs.shared_prefix_min_tokens)
    prefix_masked = float(1 - loss_mask.sum() / completions.response_mask.float().sum().clamp_min(1))
    truncated = torch.tensor([reason != "stop" for reason in completions.finish_reason], dtype=torch.bool)
    if grouped and knobs.mask_truncated:  # cut by a limit: out of the loss, its reward still in its group's advantages
        loss_mask = loss_mask * (~truncated).float().unsqueeze(1)
    # in the batch for its shape only: weight 0 in every reduction
    shape_only = filler | torch.isin(group_ids, torch.as_tensor(list(padding), dtype=torch.long))
    loss_mask = loss_mask * (~shape_only).float().unsqueeze(1)
    advantages = torch.where(shape_only, torch.zeros_like(advantages), advantages)
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
        turn_rewards=None if completions.turn_rewards is None else completions.turn_rewards.float() * loss_mask,
        routes=completions.routes,
    )
    response_len = completions.response_mask.sum(1).round().long()
    group_size = torch.bincount(group_ids[:episodes])[group_ids]  # the group's episodes
    table = pd.DataFrame({
        "sample_id": sample_ids.numpy().astype("int64"),
        "sample_of": torch.where(filler, -1, sample_ids[owner]).numpy().astype("int64"),
        "prompt_id": [int(prompt_ids[g]) for g in group_ids.tolist()],
        "group_id": group_ids.numpy().astype("int64"),
        "group_size": group_size.numpy().astype("int64"),
        "reward": reward_t.double().numpy(),
        "advantage": advantages.double().numpy(),
        "response_len": response_len.numpy().astype("int64"),
        "truncated": truncated.tolist(),
        "masked_len": (completions.response_mask.sum(1) - loss_mask.sum(1)).round().long().numpy().astype("int64"),
        # an agent episode that could not start (rl_core.agents.Episode.unstarted): no response, no loss token
        "started": [started[o] for o in owner.tolist()],
        "policy_version": [int(completions.policy_version)] * n_rows,
    })
    per_group = table[:episodes].groupby("group_id")["reward"].agg(["min", "max"])
    rewarded, lengths = reward_t[:episodes], response_len[:episodes]
    stats = {
        "rollout/reward_mean": float(rewarded.mean()),
        "rollout/reward_std": float(rewarded.std(unbiased=False)) if episodes > 1 else 0.0,
        "rollout/response_len_mean": float(lengths.float().mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncation_rate": float(table["truncated"][:episodes].mean()),
        "rollout/zero_adv_group_frac": float((per_group["min"] == per_group["max"]).mean()),
        "rollout/masked_prefix_frac": prefix_masked,
    }
    if completions.routes is not None:  # what routing replay adds to the batch (model.routing_replay=rollout)
        stats["rollout/routes_mb"] = completions.routes.numel() * completions.routes.element_size() / 2**20
    if records is not None:
        stats.update(episode_stats(records))
    return Annotated(batch=batch, table=table, stats=stats, sampled=completions.response_mask > 0)
