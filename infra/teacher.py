"""The OPD teacher role: a frozen model in its own Ray actor, scoring the student's sampled tokens.

`TeacherWorker` rebuilds the config from the recipe path + dotlist (like `PolicyWorker`), loads
`model.teacher` with the policy's dtype, freezes it and answers `score(batch) -> teacher_logp [B, T]`
with `rl_core.algorithms.opd.teacher_logprobs` at the loss temperature (`rl.temperature`), in chunks
of `rl.micro_batch_per_replica` rows. There is no weight-sync edge to it: its weights never change.

`TeacherRole` places the actor on the Ray cluster a `Cluster` joined or started (enter it inside
the `Cluster` context) and kills it on exit. On a GPU cluster the teacher takes
`cluster.gpus_per_worker` GPUs; on CPU it reserves no CPU (it runs between the workers' train steps).
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Self

import ray
import torch

from rl_core.config import PosttrainConfig


class TeacherWorker:
    """The frozen teacher model. Created as a Ray actor by `TeacherRole`."""

    def __init__(self, recipe: str, overrides: list[str], cwd: str, threads: int):
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        torch.set_num_threads(max(int(threads), 1))
        from rl_core.config import load_config
        from rl_core.models import load_policy

        self.cfg = load_config(recipe, overrides)
        if not self.cfg.model.teacher:
            raise ValueError("model.teacher is not set: the OPD teacher role needs a teacher model")
        model, _ = load_policy(self.cfg.model.model_copy(update={"name_or_path": self.cfg.model.teacher}))
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model = model.to(self.device).eval().requires_grad_(False)

    def ready(self) -> str:
        return str(self.cfg.model.teacher)

    def score(self, batch: Any) -> torch.Tensor:
        """`teacher_logp [B, T]` float32 (0 off the loss mask) of the batch's sampled tokens, on CPU."""
        from rl_core.algorithms.opd import teacher_logprobs

        out = teacher_logprobs(self.model, batch, temperature=self.cfg.rl.temperature,
                               micro_batch_size=self.cfg.rl.micro_batch_per_replica)
        return out.cpu()


class TeacherRole(AbstractContextManager):
    """Places one `TeacherWorker` actor (Ray must be initialised: enter it inside `Cluster`)."""

    def __init__(self, cfg: PosttrainConfig, recipe: str, overrides: list[str]):
        self.cfg, self.recipe, self.overrides = cfg, str(Path(recipe).resolve()), list(overrides)
        self.actor: Any = None

    def __enter__(self) -> Self:
        c = self.cfg.cluster
        on_gpu = c.gpus_per_worker > 0
        actor = ray.remote(TeacherWorker).options(num_cpus=c.cpus_per_worker if on_gpu else 0,
                                                  num_gpus=c.gpus_per_worker if on_gpu else 0)
        try:
            self.actor = actor.remote(self.recipe, self.overrides, os.getcwd(), max(int(c.cpus_per_worker), 1))
            ray.get(self.actor.ready.remote())
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
