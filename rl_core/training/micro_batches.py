"""How the trainer cuts one mini-batch into micro-batches (chunks): by rows, by a token budget, or by default
rows grouped by length when padding to the longest would waste (`Trajectory.padding_budget`).

Sharded with a token budget, ranks may cut different numbers of chunks while FSDP's collectives need the same number
of forwards and backwards on every rank: the short ranks add padding chunks (one row, no loss token, weight 0) up to
the longest's count.
"""

from __future__ import annotations

import torch

from rl_core.batch.trajectory import Trajectory
from rl_core.primitives.objective import Reduction
from rl_core.training.data_parallel import DataParallelReducer


def plan_micro_batches(mini: Trajectory, micro_batch_size: int | None, max_tokens: int | None, *,
                       reduction: Reduction, reducer: DataParallelReducer | None,
                       device: torch.device) -> list[tuple[Trajectory, bool]]:
    """The chunks of one mini-batch as `(chunk, padding)`: `micro_batch_size` rows, or whole rows grouped under a
    `max_tokens` budget (`LLMTrainer.train_step`). `reducer`: the data-parallel hook of a sharded model (None
    unsharded), whose `all_reduce_max_` aligns the ranks' chunk counts."""
    sharded = reducer is not None
    default = micro_batch_size is None and max_tokens is None and reduction is Reduction.TOKEN_SUM
    if default:  # no option set: rows grouped by length when padding to the longest would waste (padding_budget)
        max_tokens = mini.padding_budget()
    if max_tokens is None and not (default and sharded):
        chunks = mini.split(micro_batch_size or len(mini))
        if reduction is Reduction.MEAN and len({len(c) for c in chunks}) > 1:
            raise ValueError(f"Reduction.MEAN divides by the number of chunks, so chunks must be equal: "
                             f"micro_batch_size={micro_batch_size} does not divide the mini-batch of {len(mini)} rows")
        return [(c, False) for c in chunks]
    if reduction is not Reduction.TOKEN_SUM:
        raise ValueError("micro_batch_max_tokens (rl.micro_batch_max_tokens) cuts chunks of unequal sizes, but this "
                         "objective's Reduction.MEAN divides by the number of chunks, so its chunks must be equal: "
                         "use micro_batch_size (rl.micro_batch_per_replica) instead")
    chunks = [(c, False) for c in (mini.token_budget_split(max_tokens, micro_batch_size) if max_tokens else [mini])]
    if sharded:
        count = torch.tensor([len(chunks)], dtype=torch.float64, device=device)
        reducer.all_reduce_max_([count])
        pad = mini.slice(0, 1)
        pad = pad.replace(loss_mask=torch.zeros_like(pad.loss_mask))
        chunks += [(pad, True)] * (int(count.item()) - len(chunks))
    return chunks
