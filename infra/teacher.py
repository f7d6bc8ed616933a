"""The OPD teacher role: a frozen model in its own Ray actor, scoring the student's sampled tokens.

`TeacherWorker` receives the resolved config as data (like `PolicyWorker`), loads `model.teacher`
in the policy's compute dtype (`model.compute_dtype`) on its device, freezes it and answers `score(batch) -> teacher_logp [B, T]`
with `rl_core.algorithms.opd.teacher_logprobs` at the loss temperature (`rl.temperature`), in chunks
of `rl.micro_batch_per_replica` rows. There is no weight-sync edge to it: its weights never change.

`TeacherRole` places the actor on the Ray cluster a `Cluster` joined or started (enter it inside
the `Cluster` context) and kills it on exit. On a GPU cluster the teacher takes
`cluster.gpus_per_worker` GPUs; on CPU it reserves no CPU (it runs between the workers' train steps).
Placement waits at most `cluster.placement_timeout_s`, then fails naming what Ray could not place.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Self

import ray
import torch

from rl_core.config import PosttrainConfig


class TeacherWorker:
    """The frozen teacher model. Created as a Ray actor by `TeacherRole`."""

    def __init__(self, cfg_data: dict, threads: int, gpus: float):
        from infra.engines import actor_device, enable_tf32
        from rl_core.config import config_from_dict
        from rl_core.models import load_policy

        torch.set_num_threads(max(int(threads), 1))
        self.cfg = config_from_dict(cfg_data)
        if not self.cfg.model.teacher:
            raise ValueError("model.teacher is not set: the OPD teacher role needs a teacher model")
        self.device = actor_device(gpus)
        enable_tf32(self.device)
        model, _ = load_policy(self.cfg.model.model_copy(update={"name_or_path": self.cfg.model.teacher}),
                               device=self.device, dtype=self.cfg.model.compute_dtype)  # frozen: compute dtype
        self.model = model.eval().requires_grad_(False)

    def ready(self) -> str:
        return str(self.cfg.model.teacher)

    def score(self, batch: Any) -> torch.Tensor:
        """`teacher_logp [B, T]` float32 (0 off the loss mask) of the batch's sampled tokens, on CPU."""
        from rl_core.algorithms.opd import teacher_logprobs

        out = teacher_logprobs(self.model, batch.to(self.device), temperature=self.cfg.rl.temperature,
                               micro_batch_size=self.cfg.rl.micro_batch_per_replica)
        return out.cpu()


class TeacherRole(AbstractContextManager):
    """Places one `TeacherWorker` actor (Ray must be initialised: enter it inside `Cluster`)."""

    def __init__(self, cfg: PosttrainConfig):
        self.cfg = cfg
        self.actor: Any = None

    def __enter__(self) -> Self:
        from infra.cluster import PlacementError, describe_resources
        from infra.policy_worker import worker_config

        c = self.cfg.cluster
        on_gpu = c.gpus_per_worker > 0
        actor = ray.remote(TeacherWorker).options(num_cpus=c.cpus_per_worker if on_gpu else 0,
                                                  num_gpus=c.gpus_per_worker if on_gpu else 0)
        try:
            self.actor = actor.remote(worker_config(self.cfg), max(int(c.cpus_per_worker), 1),
                                      c.gpus_per_worker if on_gpu else 0.0)
            try:
                ray.get(self.actor.ready.remote(), timeout=c.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise PlacementError(
                    f"Ray could not place the OPD teacher ({c.cpus_per_worker if on_gpu else 0:g} CPU, "
                    f"{c.gpus_per_worker if on_gpu else 0:g} GPU) within cluster.placement_timeout_s="
                    f"{c.placement_timeout_s:g}; available now: {describe_resources(ray.available_resources())}. "
                    "The teacher needs GPUs beyond the trainer ranks' and engines'") from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def score(self, batch: Any) -> torch.Tensor:
        return ray.get(self.actor.score.remote(batch))

    def __exit__(self, *exc: object) -> None:
        if self.actor is not None:
            with contextlib.suppress(Exception):  # already dead, or Ray already stopped
                ray.kill(self.actor, no_restart=True)
            self.actor = None
