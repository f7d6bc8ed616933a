"""Compute placement: a Ray cluster (local or joined), the trainer ranks and the rollout engines.

Roles, all Ray actors in placement groups whose CPUs/GPUs Ray counts (the driver holds no model):

- `PolicyWorker`: one data-parallel trainer rank (model, objective, `LLMTrainer`). The ranks form
  torch's default process group over a `tcp://` rendezvous at rank 0's node IP and a free port
  (gloo on CPU, NCCL on GPU), so they may sit on different nodes; the trainer's data-parallel hook
  sums numerator gradients and weights across it (the objective contract).
- Rollout engines, by `cluster.placement`:
  - `colocated` (default): one engine inside every trainer rank, on the rank's device. The HF
    engine samples from the trainer's own model (a sync moves nothing); vLLM gets the weights in
    process and sleeps while the trainer steps (on GPU).
  - `separate`: `rollout.num_engines` `RolloutWorker` actors on their own CPUs/GPUs; trainer rank 0
    broadcasts every new policy version to them over a weight-sync group of its own (gloo on CPU,
    NCCL on GPU), in dtype buckets. Nothing goes through the driver or Ray's object store.
  Every sync carries the policy version and a checksum of the weights; each engine echoes both and
  a mismatch fails the step (`WeightSyncError`).

Actors receive the resolved, validated config as data (local model paths made absolute by the
driver): they never re-run a recipe file nor depend on the driver's working directory. On a
cluster of several machines those paths must exist on every node (a shared filesystem), or the
model must be a hub id.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Self

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from infra.engines import EnginePool, RolloutWorker, actor_device, build_engine, node_info, num_engines
from infra.ray_connect import connect_ray
from rl_core.config import PosttrainConfig, config_from_dict
from rl_core.config.loader import config_dict
from rl_core.models import looks_local
from rl_core.registry import build_objective

log = logging.getLogger("posttrain.cluster")


class WeightSyncError(RuntimeError):
    """An engine did not end a weight sync on the version and checksum that trainer rank 0 sent."""


class PlacementError(RuntimeError):
    """Ray could not place a role within `cluster.placement_timeout_s`."""


# ------------------------------------------------------------------------------------------ config


def _absolute_if_local(value: str | None) -> str | None:
    """A local model directory as an absolute path of the driver's machine; hub ids unchanged."""
    if not value:
        return value
    return str(Path(value).expanduser().resolve()) if looks_local(value) else value


def worker_config(cfg: PosttrainConfig) -> dict:
    """The config the actors get, as plain data: local model paths made absolute (no cwd on the far side)."""
    data = config_dict(cfg)
    data["model"]["name_or_path"] = _absolute_if_local(cfg.model.name_or_path)
    data["model"]["teacher"] = _absolute_if_local(cfg.model.teacher)
    data["rl"]["reference"] = _absolute_if_local(cfg.rl.reference)
    return data


# ------------------------------------------------------------------------------------------ actors


class PolicyWorker:
    """One data-parallel trainer rank (and, colocated, its rollout engine). Created as a Ray actor by `Cluster`."""

    def __init__(self, cfg_data: dict, rank: int, world_size: int, threads: int, gpus: float):
        torch.set_num_threads(max(int(threads), 1))
        self.cfg = config_from_dict(cfg_data)
        self.rank, self.world_size = rank, world_size
        self.device = actor_device(gpus)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.trainer = self.tokenizer = self.engine = None
        self._store = self._weight_store = self.weight_group = None
        self.layout: list | None = None

    def info(self) -> dict[str, Any]:
        return node_info(self.device)

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: a TCP store on this node for the data-parallel group; `(node ip, port)`."""
        from infra.distributed import node_ip, open_store

        ip = node_ip()
        self._store, port = open_store(ip, self.world_size)
        return ip, port

    def setup(self, host: str | None, port: int | None, max_model_len: int | None) -> int:
        """Join the data-parallel group (world > 1), build model, objective and trainer, and the colocated engine."""
        from infra.distributed import connect_store, init_default_group, node_ip
        from rl_core.trainer import ProcessGroupReducer

        reducer = None
        if self.world_size > 1:
            store = self._store or connect_store(host, port, self.world_size)
            init_default_group(self.backend, store, self.rank, self.world_size, node_ip())
            reducer = ProcessGroupReducer()
        self.trainer, self.tokenizer = build_trainer(self.cfg, reducer, self.device)
        if self.cfg.cluster.placement == "colocated":
            # a sharded trainer model cannot generate alone (its forwards are collectives): the engine gets a copy
            shared = None if self.trainer.sharded else self.trainer.model
            self.engine = build_engine(self.cfg, self.device, model=shared, tokenizer=self.tokenizer,
                                       max_model_len=max_model_len, sleep_mode=True)
        return self.rank

    # -- rollout (colocated)
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Any, prompt_offset: int) -> tuple[Any, float]:
        completions = self.engine.generate(prompt_ids, n, sampling, prompt_offset=prompt_offset)
        return completions, self.engine.last_generate_s

    def sync_colocated(self, version: int) -> dict[str, Any]:
        """Hand this rank's weights to its own engine (HF: it samples from them already); echo version + checksum."""
        from infra.distributed import state_checksum

        t = time.perf_counter()
        layout = self.weight_layout()
        if getattr(self.engine, "model", None) is self.trainer.model:
            state = self.trainer.model.state_dict()
            self.engine.set_policy_version(version)
        else:  # every rank gathers (sharded) and casts to the engine's dtype, one tensor at a time
            state = self.trainer.full_model_state(self._wire_dtype())
            self.engine.update_weights(state, version)
        return {"version": self.engine.policy_version, "checksum": state_checksum(state, layout),
                "seconds": time.perf_counter() - t, "bytes": 0}

    def _wire_dtype(self) -> torch.dtype:
        from rl_core.models import torch_dtype

        return torch_dtype(self.cfg.model.compute_dtype)

    # -- weight sync to separate engines (rank 0)
    def weight_layout(self) -> list:
        from infra.distributed import wire_layout

        if self.layout is None:
            self.layout = wire_layout(self.trainer.model.state_dict(), self.cfg.model.compute_dtype)
        return self.layout

    def open_weight_group(self, world_size: int) -> tuple[str, int]:
        from infra.distributed import node_ip, open_store

        ip = node_ip()
        self._weight_store, port = open_store(ip, world_size)
        return ip, port

    def join_weight_group(self, world_size: int) -> int:
        from infra.distributed import WeightGroup, node_ip

        self.weight_group = WeightGroup(self._weight_store, 0, world_size, self.backend, node_ip())
        return 0

    def broadcast_weights(self, version: int) -> dict[str, Any] | None:
        """Rank 0 sends the weights to the engines; when sharded every rank calls this (the gather is collective)."""
        from infra.distributed import send_state

        t = time.perf_counter()
        state = self.trainer.full_model_state(self._wire_dtype()) if self.trainer.sharded \
            else self.trainer.model.state_dict()
        if self.rank != 0:
            return None
        digest, sent = send_state(self.weight_group, state, self.weight_layout(), self.device)
        return {"version": int(version), "checksum": digest, "bytes": sent, "seconds": time.perf_counter() - t}

    # -- training
    def train_step(self, shard: Any) -> dict[str, float]:
        """One train step on this rank's shard. On GPU also `perf/gpu_rollout_used_gib` (device memory in use
        before the step: the trainer plus an awake colocated engine) and `perf/gpu_train_peak_gib` (torch's peak
        allocation during the step)."""
        gpu = self.device.type == "cuda"
        if gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            rollout_used = (total - free) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.engine is not None:
            self.engine.sleep()  # colocated vLLM on GPU: free its memory for the step
        t0 = time.perf_counter()
        rl = self.cfg.rl
        metrics = self.trainer.train_step(shard, rl.micro_batch_per_replica, rl.mini_batch_per_replica)
        self.trainer.release_gradients()  # not needed until the next step: frees memory for the rollout
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["perf/train_compute_s"] = time.perf_counter() - t0
        if gpu:
            metrics["perf/gpu_rollout_used_gib"] = rollout_used
            metrics["perf/gpu_train_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def evaluate_pairs(self, batch: Any, split: str = "val") -> dict[str, float]:
        """DPO: held-out pair metrics (`val/loss`, `val/reward_accuracy`, ...) of this rank's policy, no grad."""
        from rl_core.algorithms.dpo import evaluate_pairs

        with self.trainer.autocast():
            return evaluate_pairs(self.trainer.objective, self.trainer.model, batch.to(self.device),
                                  micro_batch_size=self.cfg.rl.micro_batch_per_replica, split=split)

    def reference_logps(self, batch: Any, micro_batch_size: int) -> torch.Tensor:
        """DPO: the batch's per-token reference log-probs (the frozen initial policy, or `rl.reference`), on CPU.

        The reference is loaded for this call and dropped afterwards; the scores are cached by the flow.
        """
        from rl_core.algorithms.dpo import with_reference_logps
        from rl_core.models import load_policy

        model_cfg = self.cfg.model if self.cfg.rl.reference is None else \
            self.cfg.model.model_copy(update={"name_or_path": self.cfg.rl.reference})
        reference, _ = load_policy(model_cfg, device=self.device, dtype=self.cfg.model.compute_dtype)
        with self.trainer.autocast():
            scored = with_reference_logps(reference, batch.to(self.device), temperature=self.cfg.rl.temperature,
                                          micro_batch_size=micro_batch_size)
        return scored.ref_logp.cpu()

    # -- checkpoints
    def trainer_state(self, full: bool) -> dict[str, Any]:
        """Rank 0: the whole trainer state (on CPU, gathered when sharded: every rank calls this); other ranks:
        only their RNG (weights and optimizer are identical, or rank 0 gathered them)."""
        state = self.trainer.state_dict()
        return _to_cpu(state) if full else {"rng": state["rng"]}

    def load_trainer_state(self, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
        self.trainer.load_state_dict(state if rng is None else {**state, "rng": rng})

    def save_pretrained(self, path: str) -> str | None:
        """Rank 0 saves the policy (float32) and its tokenizer as a transformers directory (safetensors).

        Sharded, every rank calls this: the full weights are gathered first.
        """
        state = self.trainer.full_model_state() if self.trainer.sharded else None
        if self.rank != 0:
            return None
        if state is None:
            self.trainer.model.save_pretrained(path, safe_serialization=True)
        else:
            self.trainer.model.save_pretrained(path, state_dict=_to_cpu(state), safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path

    def shutdown(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def build_trainer(cfg: PosttrainConfig, dp_reducer: Any = None, device: torch.device | None = None):
    """`(trainer, tokenizer)` of one rank: policy (+ frozen reference when the objective needs one), objective."""
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.models import load_policy, torch_dtype
    from rl_core.trainer import LLMTrainer

    torch.manual_seed(cfg.job.seed)
    model, tokenizer = load_policy(cfg.model, device=device)  # float32 master weights
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.cluster.sharding == "fsdp" and cfg.cluster.num_workers > 1:
        from infra.distributed import shard_policy

        shard_policy(model, device or torch.device("cpu"), torch_dtype(cfg.model.compute_dtype))
    objective = build_objective(cfg, ObjectiveContext.from_config(cfg))  # the registry's, or rl.custom_objective
    auxiliary: dict[str, torch.nn.Module] = {}
    if objective.reference_scorer is not None:
        ref_cfg = cfg.model if cfg.rl.reference is None else cfg.model.model_copy(update={"name_or_path": cfg.rl.reference})
        reference, _ = load_policy(ref_cfg, device=device, dtype=cfg.model.compute_dtype)  # frozen: compute dtype
        reference.eval().requires_grad_(False)
        auxiliary["reference"] = reference
    trainer = LLMTrainer(model, objective, cfg.rl.optimizer, auxiliary_models=auxiliary, dp_reducer=dp_reducer,
                         compute_dtype=torch_dtype(cfg.model.compute_dtype))
    return trainer, tokenizer


# ------------------------------------------------------------------------------------------ Ray


class Cluster(AbstractContextManager):
    """Joins or starts Ray, then places the trainer ranks and the rollout engines (see the module docstring).

    On exit (also on failure) every actor is killed, the placement groups are removed and a Ray that
    this object started is stopped. `max_model_len`: the longest prompt plus `rollout.max_tokens`
    (vLLM sizes its KV cache with it).
    """

    def __init__(self, cfg: PosttrainConfig, *, max_model_len: int | None = None, with_engines: bool = True):
        self.cfg = cfg
        self.worker_cfg = worker_config(cfg)
        self.max_model_len = max_model_len
        self.with_engines = with_engines
        self.workers: list[Any] = []
        self.engine_actors: list[Any] = []
        self.placement_groups: list[Any] = []
        self.engines: EnginePool | None = None
        self.started_ray = False
        self._weight_world = 0

    # -- lifecycle
    def __enter__(self) -> Self:
        try:
            self.started_ray = connect_ray(self.cfg)
            self._place_workers()
            if self.with_engines:
                self._place_engines()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _placement_group(self, bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
        timeout = self.cfg.cluster.placement_timeout_s
        pg = placement_group(bundles, strategy=strategy)
        self.placement_groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not place {what} within cluster.placement_timeout_s={timeout:g}: {len(bundles)} bundle(s) "
                f"of {bundles[0]} with strategy {strategy}; available now: {_resources(ray.available_resources())} "
                f"of {_resources(ray.cluster_resources())}. Lower the request (cluster.num_workers, *_per_worker, "
                "rollout.num_engines, *_per_engine), relax cluster.placement_strategy, or add nodes") from None
        return pg

    @staticmethod
    def _bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}

    def _place_workers(self) -> None:
        c = self.cfg.cluster
        pg = self._placement_group([self._bundle(c.cpus_per_worker, c.gpus_per_worker)] * c.num_workers,
                                   c.placement_strategy, f"{c.num_workers} trainer rank(s)")
        actor = ray.remote(PolicyWorker)
        self.workers = [
            actor.options(num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_worker,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))
            .remote(self.worker_cfg, r, c.num_workers, max(int(c.cpus_per_worker), 1), c.gpus_per_worker)
            for r in range(c.num_workers)
        ]
        host, port = ray.get(self.workers[0].open_rendezvous.remote()) if c.num_workers > 1 else (None, None)
        ray.get([w.setup.remote(host, port, self.max_model_len) for w in self.workers])

    def _place_engines(self) -> None:
        c = self.cfg.cluster
        if c.placement == "colocated":
            self.engines = EnginePool(self.workers)
            return
        count = num_engines(self.cfg)
        pg = self._placement_group([self._bundle(c.cpus_per_engine, c.gpus_per_engine)] * count, "PACK",
                                   f"{count} rollout engine(s)")
        actor = ray.remote(RolloutWorker)
        self.engine_actors = [
            actor.options(num_cpus=c.cpus_per_engine, num_gpus=c.gpus_per_engine,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            .remote(self.worker_cfg, i, max(int(c.cpus_per_engine), 1), c.gpus_per_engine, self.max_model_len)
            for i in range(count)
        ]
        self.engines = EnginePool(self.engine_actors)
        # the weight-sync group: trainer rank 0 is its rank 0, engine i its rank i + 1
        world = count + 1
        layout = ray.get(self.workers[0].weight_layout.remote())
        host, port = ray.get(self.workers[0].open_weight_group.remote(world))
        backend = "nccl" if c.gpus_per_worker > 0 and c.gpus_per_engine > 0 else "gloo"
        if backend == "gloo" and (c.gpus_per_worker > 0 or c.gpus_per_engine > 0):
            log.warning("weight sync over gloo: trainer and engines are not both on GPUs")
        joins = [self.workers[0].join_weight_group.remote(world)]
        joins += [e.join_weight_group.remote(host, port, world, i + 1, backend, layout)
                  for i, e in enumerate(self.engine_actors)]
        ray.get(joins)
        self._weight_world = world

    def __exit__(self, *exc: object) -> None:
        for actor in self.engine_actors + self.workers:
            with contextlib.suppress(Exception):  # the actor or Ray may already be gone
                ray.get(actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.workers, self.engine_actors, self.engines = [], [], None
        for pg in self.placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.placement_groups = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False

    # -- phases
    def train(self, batch: Any) -> list[dict[str, float]]:
        """Split the batch into one equal contiguous shard per worker and run one train step on each."""
        n = len(self.workers)
        size = batch.batch_size // n
        shards = [batch.select(list(range(r * size, (r + 1) * size))) for r in range(n)]
        return ray.get([w.train_step.remote(s) for w, s in zip(self.workers, shards)])

    def sync_weights(self, version: int) -> dict[str, float]:
        """Bring every engine to rank 0's weights as policy `version`; check the echoed versions and checksums.

        Returns `perf/weight_sync_s` and `perf/weight_sync_bytes` (bytes each engine received; 0 colocated).
        """
        t = time.perf_counter()
        if self.cfg.cluster.placement == "colocated":
            results = ray.get([w.sync_colocated.remote(version) for w in self.workers])
            sent, echoes = results[0], list(enumerate(results))
        else:
            sent_refs = [w.broadcast_weights.remote(version) for w in self.workers]  # rank 0 sends
            received = ray.get([e.receive_weights.remote(version) for e in self.engine_actors])
            sent = ray.get(sent_refs)[0]
            echoes = list(enumerate(received))
        for i, echo in echoes:
            if echo["version"] != version or echo["checksum"] != sent["checksum"]:
                raise WeightSyncError(
                    f"weight sync of policy version {version}: engine {i} reports version {echo['version']} with "
                    f"checksum {echo['checksum']}, but trainer rank 0 has checksum {sent['checksum']}: the engine "
                    "would sample from stale or corrupted weights; the step is stopped")
        return {"perf/weight_sync_s": time.perf_counter() - t, "perf/weight_sync_bytes": float(sent["bytes"])}

    def node_map(self) -> dict[str, list[dict[str, Any]]]:
        """Where each role runs: `{"trainers": [...], "engines": [...]}` of node id, ip, pid and device."""
        trainers = ray.get([w.info.remote() for w in self.workers])
        engines = ray.get([e.info.remote() for e in self.engine_actors]) if self.engine_actors else trainers
        return {"trainers": trainers, "engines": engines}

    def evaluate_pairs(self, batch: Any, split: str = "val") -> dict[str, float]:
        """DPO: held-out pair metrics of the policy, from rank 0 (the ranks hold the same weights; sharded, every
        rank runs the forwards, which are collectives)."""
        workers = self.workers if self.cfg.cluster.sharding == "fsdp" else self.workers[:1]
        return ray.get([w.evaluate_pairs.remote(batch, split) for w in workers])[0]

    def reference_logps(self, batch: Any, micro_batch_size: int) -> torch.Tensor:
        """DPO: the reference's per-token log-probs of `batch`, scored on trainer rank 0."""
        return ray.get(self.workers[0].reference_logps.remote(batch, micro_batch_size))

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
        """The policy as a transformers directory, written by rank 0 (sharded: every rank joins the gather)."""
        workers = self.workers if self.cfg.cluster.sharding == "fsdp" else self.workers[:1]
        return ray.get([w.save_pretrained.remote(str(Path(path).resolve())) for w in workers])[0]


def _resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU", "memory") or k.startswith("accelerator")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "nothing"
