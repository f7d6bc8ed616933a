"""Data parallelism as the trainer sees it: its reduction hook (`LLMTrainer(dp_reducer=...)`), the collectives it
needs and their implementation over a `torch.distributed` process group; and whether a model or tensor is sharded
by FSDP2; the bucketed all-reduce of unsharded gradients."""

from __future__ import annotations

from typing import Protocol

import torch


class DataParallelReducer(Protocol):
    """The data-parallel hook (`dp_reducer`): collectives over every rank of the policy's DP group.

    `all_reduce_(tensors)`: sum each tensor in place across ranks (required).
    `all_reduce_max_(tensors)`: elementwise max in place across ranks (optional; without it the
    `*_min` / `*_max` diagnostics stay rank-local).
    Every rank calls them the same number of times, in the same order, with tensors of the same
    shapes and dtypes: the trainer guarantees this when every rank runs the same objective and the
    same number of optimizer steps (the same `mini_batch_size` split), whatever its number of rows.
    """

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None: ...


class ProcessGroupReducer:
    """`DataParallelReducer` over an initialised `torch.distributed` process group (gloo / NCCL)."""

    def __init__(self, group=None):
        self.group = group

    def _reduce(self, tensors: list[torch.Tensor], op) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupReducer needs an initialised torch.distributed process group")
        for t in tensors:
            dist.all_reduce(t, op=op, group=self.group)

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        self._reduce(tensors, dist.ReduceOp.SUM)

    def all_reduce_max_(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        self._reduce(tensors, dist.ReduceOp.MAX)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is wrapped by torch FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(model, FSDPModule)


def is_dtensor(value) -> bool:
    """Whether `value` is a DTensor (an FSDP2 shard or a tensor computed from shards)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(value, DTensor)


def all_reduce_in_buckets(grads: list[torch.Tensor], reducer: DataParallelReducer, bucket_bytes: int) -> None:
    """Sum `grads` in place across ranks, in flat one-dtype buckets of at most `bucket_bytes` (a larger tensor
    alone): one collective per bucket, at most one bucket of extra memory."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads + [None]:
        if g is not None and (not bucket or (g.dtype == bucket[0].dtype
                                            and size + g.numel() * g.element_size() <= bucket_bytes)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        flat = torch.cat([b.reshape(-1) for b in bucket])
        reducer.all_reduce_([flat])
        for b, part in zip(bucket, torch.split(flat, [b.numel() for b in bucket])):
            b.copy_(part.view_as(b))
        if g is not None:
            bucket, size = [g], g.numel() * g.element_size()
