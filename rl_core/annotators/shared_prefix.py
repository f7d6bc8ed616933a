"""Shared-prefix loss mask (docs/objectives.md).

Inside one group, when two or more completions share a maximal common token prefix of at least
`min_tokens` tokens and their rewards differ, the shared prefix tokens of those completions get loss
mask 0: identical tokens pushed with opposite credit only add noise. A completion that is entirely
the prefix keeps its tokens.

Equivalently, per completion i: `m_i = max { p_ij : j in i's group, r_j != r_i, p_ij >= min_tokens }`
where `p_ij` is the common prefix length of the two responses; its first `m_i` response tokens are
masked unless `m_i >= L_i` (the whole completion is the prefix).
"""

from __future__ import annotations

import torch


def _common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if differ.numel() else n


def shared_prefix_lengths(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    min_tokens: int,
) -> torch.Tensor:
    """`m_i` of the module docstring for each row: response tokens to mask. `[B, T]`... -> `[B]` long.

    A row's response is its loss-mask tokens, in order (`input_ids[i][loss_mask[i] > 0]`).
    """
    b = input_ids.shape[0]
    out = torch.zeros(b, dtype=torch.long)
    if min_tokens <= 0 or b == 0:
        return out
    responses = [input_ids[i][loss_mask[i] > 0] for i in range(b)]
    r = rewards.tolist()
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        groups.setdefault(int(g), []).append(i)
    for rows in groups.values():
        for x in range(len(rows)):
            for y in range(x + 1, len(rows)):
                i, j = rows[x], rows[y]
                if r[i] == r[j]:
                    continue
                p = _common_prefix_length(responses[i], responses[j])
                if p >= min_tokens:
                    out[i] = max(int(out[i]), p)
                    out[j] = max(int(out[j]), p)
    return out


def shared_prefix_loss_mask(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    min_tokens: int,
) -> torch.Tensor:
    """The loss mask with shared prefixes zeroed (see module docstring). `[B, T]` -> `[B, T]` (dtype kept).

    `min_tokens = 0` disables the filter (returns the mask unchanged).
    """
    if min_tokens <= 0:
        return loss_mask
    lengths = shared_prefix_lengths(input_ids, loss_mask, rewards, group_ids, min_tokens)
    on = loss_mask > 0
    rank = on.long().cumsum(-1)  # 1-based index of each loss token within its response
    total = on.long().sum(-1)
    masked = lengths.clamp_max(total)
    keep_all = lengths >= total  # the whole completion is the shared prefix: keep its tokens
    drop = on & (rank <= masked.unsqueeze(-1)) & ~keep_all.unsqueeze(-1)
    return torch.where(drop, torch.zeros_like(loss_mask), loss_mask)
