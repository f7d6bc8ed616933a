"""Every role's Ray actor answers the one actor protocol (infra/workers/actor.py), and its constructor loads no model."""

from __future__ import annotations

import inspect

import pytest

from infra.workers.actor import Actor
from infra.workers.engines import RolloutWorker
from infra.workers.policy import PolicyWorker
from infra.workers.rewards import RewardWorker
from infra.workers.teacher import TeacherWorker


@pytest.mark.parametrize("cls", [PolicyWorker, RolloutWorker, TeacherWorker, RewardWorker])
def test_every_role_actor_answers_the_protocol(cls):
    for name in ("preload", "setup", "info", "shutdown"):
        assert inspect.isfunction(getattr(cls, name, None)), f"{cls.__name__}.{name}"
    assert issubclass(cls, Actor)


def test_a_colocated_engine_leaves_the_trainer_rank_its_matmul_precision(in_workdir, monkeypatch):
    """vLLM's GPU worker sets float32 matmul precision to "highest" as it starts: in a trainer rank with a colocated
    engine that would turn TF32 off for the trainer. The rank's precision is what it set before the engine."""
    import torch

    from infra.workers import policy as policy_worker
    from infra.workers.actor import worker_config
    from rl_core.config import load_config
    from tests.conftest import FAST, recipe

    seen = {}

    def engine_like_vllm(*args, **kwargs):
        seen["before"] = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # what vLLM's Worker.init_device does
        return object()

    monkeypatch.setattr(policy_worker, "build_engine", engine_like_vllm)
    cfg = load_config(recipe("arithmetic"), [*FAST, "model.name_or_path=artifacts/tiny-model/init"])
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # enable_tf32 on CUDA: the trainer's float32 paths in TF32
        worker = PolicyWorker(worker_config(cfg), 0, 1, 1, 0.0)
        worker.setup(None, None, None)
        assert seen["before"] == "high"  # the engine started after the trainer set its precision
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
