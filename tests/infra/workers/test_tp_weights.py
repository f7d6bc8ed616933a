"""The weight-sync group's ranks for tensor-parallel vLLM engines (`infra.workers.tp_weights`), without vLLM: the
ranks an engine holds, one checksum for its workers' receipts, and a receive that comes before the join. The workers
receiving a real broadcast run in tests/infra/workers/test_vllm_cpu.py (vLLM's CPU build, two worker processes)."""

from __future__ import annotations

import pytest

from infra.workers import tp_weights


def test_a_tensor_parallel_engine_holds_one_rank_per_worker_unless_it_takes_lora_adapters():
    assert tp_weights.weight_ranks(4, lora=False) == 4
    assert tp_weights.weight_ranks(4, lora=True) == 1  # the adapters go through the engine's actor
    assert tp_weights.weight_ranks(1, lora=False) == 1


def test_an_engine_reports_its_workers_checksum_only_when_they_agree():
    assert tp_weights.agreed_checksum([{"checksum": "ab"}, {"checksum": "ab"}]) == "ab"
    mixed = tp_weights.agreed_checksum([{"checksum": "ab"}, {"checksum": "cd"}])
    assert mixed not in ("ab", "cd")  # matches no sender: the run's check stops the step
    assert "worker 0: ab" in mixed and "worker 1: cd" in mixed


def test_a_worker_outside_the_group_refuses_to_receive_and_leaving_closes_its_rank():
    class Worker:
        device = "cpu"

    with pytest.raises(RuntimeError, match="join must come before receive"):
        tp_weights.receive(Worker(), [])
    tp_weights.leave(Worker())  # leaving a group never joined is a no-op

    class Group:
        closed = 0

        def close(self):
            self.closed += 1

    worker, group = Worker(), Group()
    setattr(worker, tp_weights.GROUP_ATTR, group)
    tp_weights.leave(worker)
    assert group.closed == 1 and getattr(worker, tp_weights.GROUP_ATTR) is None
    with pytest.raises(RuntimeError, match="join must come before receive"):  # out of the group: no receive
        tp_weights.receive(worker, [])
