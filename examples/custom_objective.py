"""Your own objective and reward, plugged in by import path (docs/objectives.md walks through this file).

    PYTHONPATH=. posttrain run recipes/arithmetic.py -- \
        "rl.objective={type: custom, import_path: 'examples.custom_objective:build_objective', kwargs: {clip: 1.5}}" \
        "data.rewards=[{path: 'examples.custom_objective:digit_reward'}]" rl.max_steps=25

The objective: the on-policy policy gradient of the quickstart (−A·ℓ, A the group advantage the
annotator computed over the whole batch) with the advantages clipped to ±clip (its one parameter,
`rl.objective.kwargs.clip`), reduced per token (TOKEN_SUM), so micro-batches and data-parallel ranks
give the unsplit value. The reward: partial credit per digit.
"""

from __future__ import annotations

import torch

from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.objective import OBJECTIVE_WEIGHT_SUM, MetricAdapter, Objective, Reduction

ADVANTAGE_CLIP = 2.0  # the default of the builder's `clip` parameter


class ClippedAdvantagePG:
    """loss = Σ_{i,t} M_{i,t} · (−clamp(A_i, −c, c) · ℓ_{i,t}) / Σ M   (chunk numerator / chunk weight)."""

    def __init__(self, temperature: float, clip: float):
        self.temperature, self.clip = temperature, clip

    def __call__(self, model, batch):
        logp = sequence_token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=self.temperature,
                                       loss_mask=batch.loss_mask)  # log-probs only where the loss reads them
        mask = batch.loss_mask.to(logp.dtype)
        advantages = batch.advantages.to(logp.dtype)
        if advantages.dim() == 1:  # one advantage per completion: broadcast over its tokens
            advantages = advantages.unsqueeze(-1).expand_as(logp)
        clipped = advantages.clamp(-self.clip, self.clip)
        weight = mask.sum()
        loss = (-(clipped * logp) * mask).sum() / weight.clamp_min(1)
        with torch.no_grad():
            clip_frac = float(((clipped != advantages).to(logp.dtype) * mask).sum() / weight.clamp_min(1))
        # TOKEN_SUM: the trainer multiplies back by the weight, sums over chunks and ranks, divides once
        return loss, {"pg_loss": float(loss.detach()), "advantage_clip_frac": clip_frac, OBJECTIVE_WEIGHT_SUM: float(weight)}


def build_objective(rl, context, clip: float = ADVANTAGE_CLIP) -> Objective:
    """Called as build_objective(rl, context, **rl.objective.kwargs): `rl` is the config's rl section,
    `context` holds rollout.max_tokens, rollout.temperature and the policy's identity, `clip` comes from the
    config's kwargs.
    Everything that changes the math goes in `identity` (the kwargs are added to it for you)."""
    if not clip > 0:
        raise ValueError(f"rl.objective.kwargs.clip={clip}: must be > 0")
    return Objective(
        fn=ClippedAdvantagePG(context.temperature, clip),
        reduction=Reduction.TOKEN_SUM,
        metric_adapter=MetricAdapter({"pg_loss": "loss", "advantage_clip_frac": "advantage_clip_frac"}),
        identity={"objective": "clipped_advantage_pg", "advantage_clip": clip, "temperature": context.temperature,
                  "policy": dict(context.policy_identity)},
    )


def digit_reward(completions, answer, **_):
    """A TRL-style reward: 1.0 for the exact answer; otherwise half a point spread over the answer's digits
    matched in place."""
    out = []
    for completion, want in zip(completions, answer):
        text = completion.strip().split()[0] if completion.strip() else ""
        matched = sum(a == b for a, b in zip(text, want))
        out.append(1.0 if text == want else 0.5 * matched / max(len(want), 1))
    return out
