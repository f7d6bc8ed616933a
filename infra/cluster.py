"""Compute placement: a Ray cluster (local or joined) and the data-parallel policy workers.

Each `PolicyWorker` is a Ray actor that rebuilds the config from the recipe path + dotlist, loads
the policy, builds the objective with the algorithm's module-level builder and owns an `LLMTrainer`.
Workers form one torch.distributed process group (gloo on CPU over a `file://` rendezvous kept on
loopback, NCCL on GPU); the trainer's data-parallel hook sums numerator gradients and weights
across it (SPEC §4). The driver splits a validated batch into equal shards, one per worker.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Self

import ray
import torch

from rl_core.config import PosttrainConfig

log = logging.getLogger("posttrain.cluster")

BUILDERS = {  # job.algorithm -> module whose build_objective(rl, context) makes the Objective
    "grpo": "rl_core.algorithms.grpo",
    "dr_grpo": "rl_core.algorithms.grpo",
    "gspo": "rl_core.algorithms.grpo",
    "legacy_pg": "rl_core.algorithms.grpo",
    "opd": "rl_core.algorithms.opd",
    "dpo": "rl_core.algorithms.dpo",
}


class PolicyWorker:
    """One data-parallel rank: model, objective, trainer. Created as a Ray actor by `Cluster`."""

    def __init__(self, rank: int, world_size: int, init_file: str, recipe: str, overrides: list[str],
                 cwd: str, threads: int, backend: str):
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        torch.set_num_threads(max(int(threads), 1))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        from rl_core.config import load_config

        self.cfg = load_config(recipe, overrides)
        from rl_core.trainer import ProcessGroupReducer

        self.trainer, self.tokenizer = build_trainer(self.cfg, ProcessGroupReducer() if world_size > 1 else None)

    def ready(self) -> int:
        return self.rank

    def train_step(self, shard: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        rl = self.cfg.rl
        metrics = self.trainer.train_step(shard, rl.micro_batch_per_replica, rl.mini_batch_per_replica)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["perf/train_compute_s"] = time.perf_counter() - t0
        return metrics

    def policy_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.trainer.model.state_dict().items()}

    def evaluate_pairs(self, batch: Any, split: str = "val") -> dict[str, float]:
        """DPO: held-out pair metrics (`val/loss`, `val/reward_accuracy`, ...) of this rank's policy, no grad."""
        from rl_core.algorithms.dpo import evaluate_pairs

        return evaluate_pairs(self.trainer.objective, self.trainer.model, batch,
                              micro_batch_size=self.cfg.rl.micro_batch_per_replica, split=split)

    def trainer_state(self, full: bool) -> dict[str, Any]:
        """Rank 0: the whole trainer state; other ranks: only their RNG (weights and optimizer are identical)."""
        state = self.trainer.state_dict()
        return state if full else {"rng": state["rng"]}

    def load_trainer_state(self, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
        self.trainer.load_state_dict(state if rng is None else {**state, "rng": rng})

    def save_pretrained(self, path: str) -> str:
        """Save the policy and its tokenizer as a transformers directory (safetensors)."""
        self.trainer.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path

    def shutdown(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def build_trainer(cfg: PosttrainConfig, dp_reducer: Any = None):
    """`(trainer, tokenizer)` of one rank: policy (+ frozen reference when the objective needs one), objective."""
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.models import load_policy
    from rl_core.trainer import LLMTrainer

    torch.manual_seed(cfg.job.seed)
    model, tokenizer = load_policy(cfg.model)
    builder = importlib.import_module(BUILDERS[cfg.job.algorithm]).build_objective
    context = ObjectiveContext.from_config(cfg)
    objective = builder(cfg.rl, context)
    auxiliary: dict[str, torch.nn.Module] = {}
    if objective.reference_scorer is not None:
        ref_cfg = cfg.model if cfg.rl.reference is None else cfg.model.model_copy(update={"name_or_path": cfg.rl.reference})
        reference, _ = load_policy(ref_cfg)
        reference.eval().requires_grad_(False)
        auxiliary["reference"] = reference
    trainer = LLMTrainer(model, objective, cfg.rl.optimizer, auxiliary_models=auxiliary, dp_reducer=dp_reducer)
    return trainer, tokenizer


class Cluster(AbstractContextManager):
    """Joins `cluster.address`/`RAY_ADDRESS` or starts a local Ray on 127.0.0.1, then places the workers.

    On exit (also on failure) the workers are killed and a Ray that this object started is stopped.
    """

    def __init__(self, cfg: PosttrainConfig, recipe: str, overrides: list[str]):
        self.cfg, self.recipe, self.overrides = cfg, str(Path(recipe).resolve()), list(overrides)
        self.workers: list[Any] = []
        self.started_ray = False
        self._tmp: tempfile.TemporaryDirectory | None = None

    # -- lifecycle
    def __enter__(self) -> Self:
        try:
            self._connect()
            self._place_workers()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _connect(self) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        address = self.cfg.cluster.address or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():
            return
        if address:
            ray.init(address=address, log_to_driver=True)
            log.info("joined Ray cluster at %s", address)
            return
        need = self.cfg.cluster.num_workers * self.cfg.cluster.cpus_per_worker
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
            num_gpus=torch.cuda.device_count(),
            object_store_memory=256 * 1024 * 1024,
            log_to_driver=True,
            configure_logging=False,
        )
        self.started_ray = True
        log.info("started a local Ray on 127.0.0.1")

    def _place_workers(self) -> None:
        c = self.cfg.cluster
        self._tmp = tempfile.TemporaryDirectory(prefix="posttrain-dist-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        backend = "nccl" if c.gpus_per_worker > 0 else "gloo"
        actor = ray.remote(PolicyWorker).options(num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_worker)
        self.workers = [
            actor.remote(rank, c.num_workers, init_file, self.recipe, self.overrides, os.getcwd(),
                         max(int(c.cpus_per_worker), 1), backend)
            for rank in range(c.num_workers)
        ]
        ray.get([w.ready.remote() for w in self.workers])

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):  # the worker may already be dead
                ray.get(w.shutdown.remote(), timeout=10)
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- phases
    def train(self, batch: Any) -> list[dict[str, float]]:
        """Split the batch into one equal contiguous shard per worker and run one train step on each."""
        n = len(self.workers)
        size = batch.batch_size // n
        shards = [batch.select(list(range(r * size, (r + 1) * size))) for r in range(n)]
        return ray.get([w.train_step.remote(s) for w, s in zip(self.workers, shards)])

    def policy_state(self) -> dict[str, torch.Tensor]:
        return ray.get(self.workers[0].policy_state.remote())

    def evaluate_pairs(self, batch: Any, split: str = "val") -> dict[str, float]:
        """DPO: held-out pair metrics of the policy, computed on rank 0 (the ranks hold identical weights)."""
        return ray.get(self.workers[0].evaluate_pairs.remote(batch, split))

    def trainer_parts(self) -> dict[str, Any]:
        """Checkpoint parts: `trainer` (rank 0's whole state) and `rng_rank<r>` for every rank."""
        states = ray.get([w.trainer_state.remote(r == 0) for r, w in enumerate(self.workers)])
        parts = {"trainer": states[0]}
        parts.update({f"rng_rank{r}": {"rng": s["rng"]} for r, s in enumerate(states)})
        return parts

    def load_trainer_parts(self, parts: dict[str, Any]) -> None:
        """Restore every rank from `trainer_parts()` output (same number of workers)."""
        n = len(self.workers)
        saved = sorted(k for k in parts if k.startswith("rng_rank"))
        if len(saved) != n:
            raise ValueError(f"the checkpoint holds {len(saved)} worker RNG states but cluster.num_workers={n}; "
                             "resume with the same number of workers")
        ray.get([w.load_trainer_state.remote(parts["trainer"], parts[f"rng_rank{r}"]["rng"])
                 for r, w in enumerate(self.workers)])

    def save_pretrained(self, path: str | Path) -> str:
        return ray.get(self.workers[0].save_pretrained.remote(str(Path(path).resolve())))
