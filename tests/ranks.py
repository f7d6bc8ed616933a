"""Simulated data-parallel ranks in one process (threads), for the trainer's gradient-reduction tests."""

from __future__ import annotations

import threading

import torch


class ThreadGroup:
    """An in-process process group for simulated ranks: each rank runs in its own thread."""

    def __init__(self, world_size):
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots = [None] * world_size
        self.calls = [0] * world_size

    def collective(self, rank, tensor, op):
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        parts = list(self.slots)
        assert all(p.shape == tensor.shape and p.dtype == tensor.dtype for p in parts), "ranks disagree on shape"
        out = parts[0].clone()
        for part in parts[1:]:
            out = out + part if op == "sum" else torch.maximum(out, part)
        self.barrier.wait()
        tensor.copy_(out)
        self.calls[rank] += 1

    def hook(self, rank):
        return RankReducer(self, rank)


class RankReducer:
    """The trainer's `dp_reducer` protocol for one simulated rank."""

    def __init__(self, group, rank):
        self.group, self.rank = group, rank

    def all_reduce_(self, tensors):
        for t in tensors:
            self.group.collective(self.rank, t, "sum")

    def all_reduce_max_(self, tensors):
        for t in tensors:
            self.group.collective(self.rank, t, "max")


def run_ranks(make_trainer, shares, micro, mini=None, max_tokens=None):
    """Train one step on `len(shares)` simulated ranks (threads); returns [(metrics, trainer)] per rank."""
    group = ThreadGroup(len(shares))
    trainers = [make_trainer(group.hook(r)) for r in range(len(shares))]
    out, errors = [None] * len(shares), []

    def work(r):
        try:
            out[r] = trainers[r].train_step(shares[r], micro, mini, max_tokens)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(shares))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    assert len(set(group.calls)) == 1 and group.calls[0] >= 2
    return list(zip(out, trainers))
