"""Per-token log-probs of a causal LM: the one place the trainer and the rollout engines agree on.

`ℓ_t = log_softmax(logits_{t-1} / T)[x_t]`, computed in float32 from left-padded sequences with
position ids derived from the attention mask (as `generate` does), so that sampling log-probs and
training log-probs of the same weights match.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: `cumsum(mask) - 1`, clamped at 0. Shape `[B, T]`."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits / T)` gathered at `tokens`. logits `[B, T, V]`, tokens `[B, T]` -> `[B, T]` float32."""
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of `softmax(logits / T)` per position. `[B, T, V]` -> `[B, T]` float32.

    One row at a time: its float32 temporaries are `[T, V]`, not `[B, T, V]` (at a 150k vocabulary
    they would otherwise rival the logits themselves at the loss's memory peak).
    """
    out = []
    for row in logits.split(1):
        logp = torch.log_softmax(row.float() / temperature, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def sequence_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    return_entropy: bool = False,
):
    """Log-prob of every token given its prefix. `[B, T]` ids -> `[B, T]` float32 (position 0 is 0).

    With `return_entropy=True` also returns the per-position entropy `[B, T]` (position 0 is 0).
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = out.logits[:, :-1]
    lp = logprobs_from_logits(logits, input_ids[:, 1:], temperature)
    zeros = lp.new_zeros(lp.shape[0], 1)
    lp = torch.cat([zeros, lp], dim=1)
    if not return_entropy:
        return lp
    with torch.no_grad():  # a diagnostic: no second [B, T, V] tensor kept for autograd
        ent = torch.cat([zeros, entropy_from_logits(logits, temperature)], dim=1)
    return lp, ent
