"""The OPD teacher role: frozen teacher replicas in their own Ray actors, on the trainer ranks' nodes and GPUs.

`TeacherWorker` receives the resolved config as data (like `PolicyWorker`), loads `model.teacher`
in the policy's compute dtype (`model.compute_dtype`) on its device, freezes it and answers `score(batch) -> teacher_logp [B, T]`
with `rl_core.algorithms.opd.teacher_logprobs` at the loss temperature (`rollout.temperature`), in chunks
of `rl.micro_batch_per_replica` rows. There is no weight-sync edge to it: its weights never change.

`TeacherRole` places `cluster.teacher_replicas` of them (default: one per trainer rank) in the trainer ranks'
placement group, replica i in rank i % `cluster.num_workers`'s bundle: on that rank's node, and on GPU on that
rank's GPU (Ray counts `TEACHER_GPU_SHARE` of it per replica and the rank asks for the rest; the memory plan
counts the teacher copies on the rank). It reserves no CPU: the teachers score while the trainer ranks wait for
the batch. `score` cuts the batch into one contiguous row shard per replica, scores them in parallel and
reassembles them in order (`rl_core.algorithms.opd.score_in_shards`). Enter it inside the `Cluster` context;
its `ActorGroup` (infra/workers/actor.py) starts the replicas, has them import ahead and load the teacher (`setup`), and
shuts them down and kills them on exit. Placement waits at most `cluster.placement_timeout_s`, then fails naming what Ray
could not place.
"""

from __future__ import annotations

import time
from typing import Any, Self

import ray
import torch

from infra.processes import use_threads
from infra.workers.actor import BesideRanks, start_beside_ranks
from rl_core.algorithms.opd import score_in_shards
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import teacher_replicas


class TeacherWorker:
    """One frozen teacher replica (an `infra.workers.actor.Actor`). Created as a Ray actor by `TeacherRole`."""

    def __init__(self, cfg_data: dict, threads: int, gpus: float):
        from infra.workers.actor import actor_device
        from rl_core.config import config_from_dict
        from rl_core.model.loading import enable_tf32

        use_threads(threads)
        self.cfg = config_from_dict(cfg_data)
        if not self.cfg.model.teacher:
            raise ValueError("model.teacher is not set: the OPD teacher role needs a teacher model")
        self.device = actor_device(gpus)
        enable_tf32(self.device)
        self.model: Any = None

    def preload(self) -> float:
        """Import what `setup` uses (transformers' model classes take seconds). Returns the seconds taken."""
        t = time.perf_counter()
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        from rl_core.model.loading import load_policy  # noqa: F401
        return time.perf_counter() - t

    def setup(self) -> str:
        """Load `model.teacher` in the compute dtype, frozen; returns its name."""
        from rl_core.model.loading import load_policy

        model, _ = load_policy(self.cfg.model.model_copy(update={"name_or_path": self.cfg.model.teacher}),
                               device=self.device, dtype=self.cfg.model.compute_dtype)  # frozen: compute dtype
        self.model = model.eval().requires_grad_(False)
        return str(self.cfg.model.teacher)

    def info(self) -> dict[str, Any]:
        from infra.workers.actor import node_info

        return node_info(self.device)

    def score(self, batch: Any) -> torch.Tensor:
        """`teacher_logp [B, T]` float32 (0 off the loss mask) of the batch's sampled tokens, on CPU."""
        from rl_core.algorithms.opd import teacher_logprobs

        out = teacher_logprobs(self.model, batch.to(self.device), temperature=self.cfg.rollout.temperature,
                               micro_batch_size=self.cfg.rl.micro_batch_per_replica)
        return out.cpu()

    def shutdown(self) -> None:
        self.model = None


class TeacherRole(BesideRanks):
    """Places the `TeacherWorker` replicas in the trainer ranks' placement group `trainer_group`
    (`Cluster.trainer_group`; Ray must be initialised: enter it inside `Cluster`)."""

    def __init__(self, cfg: PosttrainConfig, trainer_group: Any):
        self.cfg = cfg
        self.trainer_group = trainer_group

    def __enter__(self) -> Self:
        from infra.workers.actor import worker_config

        c = self.cfg.cluster
        replicas = teacher_replicas(self.cfg)
        if replicas < 1:
            raise ValueError(f"rl.objective.type={self.cfg.rl.objective.type!r} has no teacher role")
        cfg_data, threads = worker_config(self.cfg), max(int(c.cpus_per_worker), 1)
        self.group = start_beside_ranks(self.cfg, "teachers", TeacherWorker, replicas,
                                        lambda gpus: (cfg_data, threads, gpus), self.trainer_group,
                                        "OPD teacher replica(s) (cluster.teacher_replicas)")
        return self

    def score(self, batch: Any) -> torch.Tensor:
        """`teacher_logp [B, T]`: one contiguous row shard per replica, scored in parallel, in row order."""
        def score_all(shards: list[Any]) -> list[torch.Tensor]:
            return ray.get([a.score.remote(s) for a, s in zip(self.actors, shards)])

        return score_in_shards(batch, len(self.actors), score_all)
