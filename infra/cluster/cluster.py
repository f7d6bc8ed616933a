"""Compute placement: a Ray cluster (local or joined), the trainer ranks and the rollout engines.

Roles, all Ray actors in placement groups whose CPUs/GPUs Ray counts (the driver holds no model):

- `PolicyWorker` (infra/workers/policy.py): one data-parallel trainer rank (model, objective, `LLMTrainer`). The ranks form
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
  Every sync carries the policy version and a checksum of the weights; each engine echoes both, then reports
  what it holds after loading (per-tensor sums of its own parameters and its log-probs of a fixed probe,
  `rl_core.rollout.verify`), which the driver compares with trainer rank 0's; a mismatch fails the step
  (`WeightSyncError`, naming the engine and the worst tensor).

Ray and the actor groups belong to the `Cluster`'s `infra.cluster.placement.Placement`: the one `posttrain run` created and
started ahead of the flow (its local Ray, and the trainer ranks' and separate engines' actors, while Prefect's API
starts), or one of its own. Every actor answers the same protocol (`infra.workers.actor.Actor`: `preload`, `setup`, `info`,
`shutdown`). Trainers and separate engines build their models side by side (one after the other only when they may
share a GPU: vLLM sizes its cache from the memory free when it starts).

Actors receive the resolved, validated config as data (local model paths made absolute by the
driver): they never re-run a recipe file nor depend on the driver's working directory. On a
cluster of several machines those paths must exist on every node (a shared filesystem), or the
model must be a hub id. Trainer rank 0 writes the final model; at placement the driver checks that rank 0
sees its run directory, else the model goes through `tracking.checkpoint_uri`, and without one the run is
refused before training (`Cluster.save_pretrained`).
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Self

import ray
import torch

from infra.checkpoints.store import FINAL_MODEL, CheckpointStore
from infra.cluster.placement import Placement
from infra.workers.actor import ActorGroup, PlacementError, describe_resources  # noqa: F401 - describe_resources re-exported
from infra.workers.engines import WEIGHTS_THREAD, EnginePool
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import num_engines, shard_mesh
from rl_core.rollout.verify import compare_held, probe_gap

log = logging.getLogger("posttrain.cluster")


class WeightSyncError(RuntimeError):
    """An engine did not end a weight sync on the version and checksum that trainer rank 0 sent, or does not hold
    the weights it sent (`rl_core.rollout.verify`: its tensors' sums, its log-probs of a fixed probe)."""


def shares_gpus(cfg: PosttrainConfig) -> bool:
    """Separate engines that may share a GPU with a trainer rank (both on GPUs, either with a fraction of one)."""
    c = cfg.cluster
    return (c.placement == "separate" and c.gpus_per_worker > 0 and c.gpus_per_engine > 0
            and min(c.gpus_per_worker, c.gpus_per_engine) < 1)


class Cluster(AbstractContextManager):
    """Joins or starts Ray, then places the trainer ranks and the rollout engines (see the module docstring).

    `placement`: the `Placement` that owns Ray and the actor groups; by default the one offered by `posttrain run`
    (`Placement.take_offered`), else a new one. On exit (also on failure) every actor is shut down and killed, the
    placement groups are removed and a Ray that the placement started is stopped. `max_model_len`: the longest
    prompt plus `rollout.max_tokens` (vLLM sizes its KV cache with it).
    """

    def __init__(self, cfg: PosttrainConfig, *, max_model_len: int | None = None, with_engines: bool = True,
                 placement: Placement | None = None):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.with_engines = with_engines
        self.placement = placement
        self.engines: EnginePool | None = None
        self._weight_world = 0
        self.ranks_see_run_dir = True  # whether every trainer rank sees the driver's run directory (placement probe)
        self._written: dict[int, dict[str, dict]] = {}  # per rank: its files of the checkpoint in flight, once written

    # -- lifecycle
    def __enter__(self) -> Self:
        try:
            if self.placement is None:
                self.placement = Placement.take_offered(self.cfg) or Placement(self.cfg)
            self.placement.connect()
            setups = self._place_workers()
            if self.with_engines:
                if shares_gpus(self.cfg):  # vLLM sizes its cache from the GPU memory free at its start: trainers first
                    ray.get(setups)
                setups += self._place_engines()
            ray.get(setups)  # the trainers and the separate engines build their models side by side
            self._check_run_dir_reach()
            self._check_shard_groups()
            if self.with_engines:
                self._connect_engines()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _check_run_dir_reach(self) -> None:
        """Preflight: every trainer rank writes its checkpoint shards into the driver's run directory, and rank 0 the
        final model; do they see it (the same node, or a filesystem mounted at the same path)? Each reads a file the
        driver has just written there. A rank that does not is refused now, before training, rather than ending
        with the checkpoints on another node."""
        run_dir = Path(self.cfg.run_dir).resolve()
        if not run_dir.is_dir():
            return  # no run directory (a Cluster used outside a flow): nothing to reach
        probe = run_dir / f".rank-probe-{uuid.uuid4().hex}"
        probe.write_text(probe.name)
        try:
            seen = [text == probe.name for text in ray.get([w.read_text.remote(str(probe)) for w in self.workers])]
        finally:
            probe.unlink(missing_ok=True)
        self.ranks_see_run_dir = all(seen)
        if not self.ranks_see_run_dir:
            blind = [ray.get(self.workers[r].info.remote()) for r, ok in enumerate(seen) if not ok]
            raise PlacementError(shards_unreachable(run_dir, blind, ray.util.get_node_ip_address()))

    def _check_shard_groups(self) -> None:
        """HSDP: warn when a shard group (consecutive ranks) spans nodes, which puts its gathers on the network."""
        mesh = shard_mesh(self.cfg)
        if mesh is None or mesh[0] == 1:
            return
        nodes = [info["ip"] for info in ray.get([w.info.remote() for w in self.workers])]
        spread = [(g, sorted(set(nodes[g * mesh[1]:(g + 1) * mesh[1]]))) for g in range(mesh[0])]
        for g, ips in spread:
            if len(ips) > 1:
                log.warning("cluster.sharding=hsdp: shard group %d (ranks %d-%d) spans nodes %s, so its all-gathers and "
                            "reduce-scatters cross the network; set cluster.shard_size to the ranks of one node "
                            "(cluster.placement_strategy=PACK places consecutive ranks together)", g, g * mesh[1],
                            (g + 1) * mesh[1] - 1, ", ".join(ips))

    # the actors and placement groups are the placement's: these are views of them
    @property
    def workers(self) -> list[Any]:
        """The trainer ranks' actors, rank order."""
        return self._actors("trainers")

    @property
    def engine_actors(self) -> list[Any]:
        """The separate rollout engines' actors (none colocated)."""
        return self._actors("engines")

    @property
    def trainer_group(self) -> Any:
        """The trainer ranks' placement group (the OPD teachers join its bundles); None when not placed."""
        group = self.placement.groups.get("trainers") if self.placement is not None else None
        return group.placement_group if group is not None else None

    @property
    def started_ray(self) -> bool:
        """Whether the Ray this cluster uses was started for it (and is stopped on exit)."""
        return self.placement is not None and self.placement.started_ray

    def _actors(self, role: str) -> list[Any]:
        group = self.placement.groups.get(role) if self.placement is not None else None
        return group.actors if group is not None else []

    def _place(self, role: str, what: str) -> ActorGroup:
        """`role`'s group of the placement (started early, or now), placed within `cluster.placement_timeout_s`."""
        group = self.placement.group(role)
        group.place(self.cfg.cluster.placement_timeout_s, what,
                    "Lower the request (cluster.num_workers, *_per_worker, rollout.num_engines, *_per_engine), relax "
                    "cluster.placement_strategy, or add nodes")
        return group

    def _place_workers(self) -> list[Any]:
        """The trainer ranks' actors, placed; returns their `setup` calls, in flight."""
        c = self.cfg.cluster
        trainers = self._place("trainers", f"{c.num_workers} trainer rank(s)")
        host, port = ray.get(trainers.actors[0].open_rendezvous.remote()) if c.num_workers > 1 else (None, None)
        return trainers.setup(host, port, self.max_model_len)

    def _place_engines(self) -> list[Any]:
        """Separate placement: the engines' actors, placed; returns their `setup` calls, in flight."""
        if self.cfg.cluster.placement == "colocated":
            return []
        return self._place("engines", f"{num_engines(self.cfg)} rollout engine(s)").setup(self.max_model_len)

    def _connect_engines(self) -> None:
        """The driver's pool of engines; separate, each engine joins trainer rank 0's weight-sync group."""
        c = self.cfg.cluster
        if c.placement == "colocated":
            self.engines = EnginePool(self.workers)
            return
        self.engines = EnginePool(self.engine_actors)
        # the weight-sync group: trainer rank 0 is its rank 0, then each engine's ranks in engine order (a tensor-parallel
        # vLLM engine's workers each hold one: infra.workers.tp_weights)
        ranks = ray.get([e.weight_ranks.remote() for e in self.engine_actors])
        firsts = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        layout = ray.get(self.workers[0].weight_layout.remote())
        host, port = ray.get(self.workers[0].open_weight_group.remote(world))
        backend = "nccl" if c.gpus_per_worker > 0 and c.gpus_per_engine > 0 else "gloo"
        if backend == "gloo" and (c.gpus_per_worker > 0 or c.gpus_per_engine > 0):
            log.warning("weight sync over gloo: trainer and engines are not both on GPUs")
        joins = [self.workers[0].join_weight_group.remote(world)]
        joins += [e.join_weight_group.remote(host, port, world, first, backend, layout)
                  for first, e in zip(firsts, self.engine_actors)]
        ray.get(joins)
        self._weight_world = world

    def __exit__(self, *exc: object) -> None:
        if self.placement is not None:
            self.placement.close()
        self.engines = None

    # -- phases
    def _shards(self, batch: Any) -> list[Any]:
        """One equal contiguous shard of the batch's rows per worker, in rank order."""
        size = batch.batch_size // len(self.workers)
        return [batch.select(list(range(r * size, (r + 1) * size))) for r in range(len(self.workers))]

    def train(self, batch: Any) -> list[dict[str, float]]:
        """Split the batch into one equal contiguous shard per worker and run one train step on each."""
        return ray.get([w.train_step.remote(s) for w, s in zip(self.workers, self._shards(batch))])

    def values(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PPO: the critic's values `[B, T]` of the batch (and the reference's log-probs with a KL in the reward),
        each rank scoring the shard `train` gives it."""
        answers = ray.get([w.values.remote(s) for w, s in zip(self.workers, self._shards(batch))])
        values = torch.cat([v for v, _ in answers])
        return values, None if answers[0][1] is None else torch.cat([ref for _, ref in answers])

    def sync_weights(self, version: int) -> dict[str, float]:
        """Bring every engine to rank 0's weights as policy `version`; check the echoed versions and checksums.

        Then each engine's report of what it holds (`rl_core.rollout.verify`) is compared with rank 0's.
        Returns `perf/weight_sync_s`, `perf/weight_sync_bytes` (bytes each engine received; 0 colocated) and
        `rollout/sync_probe_logp_abs_diff` (the largest |engine - trainer| log-prob of the fixed probe, any engine).
        """
        if not self.with_engines:
            return {}  # nothing samples (a reward model's training): no engine to bring to the weights
        t = time.perf_counter()
        if self.cfg.cluster.placement == "colocated":
            results = ray.get([w.sync_colocated.remote(version) for w in self.workers])
            sent, echoes = results[0], list(enumerate(results))
        else:
            sent_refs = [w.broadcast_weights.remote(version) for w in self.workers]  # rank 0 sends
            # in flight: beside the engines' generate calls; else after those submitted before it
            receive = [e.receive_weights.options(concurrency_group=WEIGHTS_THREAD) if self.cfg.rollout.in_flight_updates
                       else e.receive_weights for e in self.engine_actors]
            received = ray.get([r.remote(version) for r in receive])
            sent = ray.get(sent_refs)[0]
            echoes = list(enumerate(received))
        for i, echo in echoes:
            if echo["version"] != version or echo["checksum"] != sent["checksum"]:
                raise WeightSyncError(
                    f"weight sync of policy version {version}: engine {i} reports version {echo['version']} with "
                    f"checksum {echo['checksum']}, but trainer rank 0 has checksum {sent['checksum']}: the engine "
                    "would sample from stale or corrupted weights; the step is stopped")
        expected = sent["expected"]
        for i, echo in echoes:
            problems = compare_held(expected, echo["held"], expected["dtype"])
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise WeightSyncError(
                    f"weight sync of policy version {version}: engine {i} does not hold what trainer rank 0 sent: "
                    f"{problems[0]}{more}. The engine would sample from other weights than the trainer's; the step is "
                    "stopped (docs/rollout.md, 'What a weight sync verifies')")
        gap = max(probe_gap(expected, echo["held"]) for _, echo in echoes)
        return {"perf/weight_sync_s": time.perf_counter() - t, "perf/weight_sync_bytes": float(sent["bytes"]),
                "rollout/sync_probe_logp_abs_diff": gap}

    def node_map(self) -> dict[str, list[dict[str, Any]]]:
        """Where each role runs: `{"trainers": [...], "engines": [...]}` of node id, ip, pid and device."""
        trainers = self.placement.groups["trainers"].info()
        if not self.with_engines:
            return {"trainers": trainers, "engines": []}
        engines = self.placement.groups["engines"].info() if self.engine_actors else trainers
        return {"trainers": trainers, "engines": engines}

    def evaluate_pairs(self, batch: Any, split: str = "val") -> dict[str, float]:
        """DPO: held-out pair metrics of the policy, from rank 0 (the ranks hold the same weights; sharded, every
        rank runs the forwards, which are collectives)."""
        workers = self.workers if shard_mesh(self.cfg) else self.workers[:1]
        return ray.get([w.evaluate_pairs.remote(batch, split) for w in workers])[0]

    def reference_logps(self, batch: Any, micro_batch_size: int) -> torch.Tensor:
        """DPO: the reference's per-token log-probs of `batch`, scored on trainer rank 0."""
        return ray.get(self.workers[0].reference_logps.remote(batch, micro_batch_size))

    def start_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Every rank starts writing its shards into `directory` (in the background, after a staging copy); returns
        the checkpoint's plain parts: `trainer` (rank 0's state without tensors) and `rng_rank<r>` for every rank.
        `checkpoint_written` says when the shards are on disk. No weights pass through the driver."""
        states = ray.get([w.start_checkpoint.remote(str(Path(directory).resolve())) for w in self.workers])
        parts = {"trainer": {k: v for k, v in states[0].items() if k != "rng"}}
        parts.update({f"rng_rank{r}": {"rng": s["rng"]} for r, s in enumerate(states)})
        return parts

    def checkpoint_written(self, wait: bool = True) -> dict[str, dict] | None:
        """The files the ranks wrote for the checkpoint in flight (`{name: {"size", "sha256"}}`, `{}` with none in
        flight) once every rank's are on disk; None when some are still being written and `wait` is false."""
        waiting = [r for r in range(len(self.workers)) if r not in self._written]
        answers = ray.get([self.workers[r].checkpoint_written.remote(wait) for r in waiting])
        self._written.update({r: files for r, files in zip(waiting, answers) if files is not None})
        if len(self._written) < len(self.workers):
            return None
        files: dict[str, dict] = {}
        for answer in self._written.values():
            files.update(answer)
        self._written = {}
        return files

    def load_checkpoint(self, directory: str | Path, parts: dict[str, Any]) -> None:
        """Restore every rank from a checkpoint directory (`start_checkpoint`'s), written by any number of ranks in any
        sharding: each reads its own layout of the shards. Rank r takes the saved RNG of rank r; a rank the checkpoint
        had not keeps its seeded generators (and with another rank count the batch split differs anyway)."""
        saved = sum(1 for k in parts if k.startswith("rng_rank"))
        if saved != len(self.workers):
            log.info("resuming a checkpoint of %d trainer rank(s) on %d", saved, len(self.workers))
        ray.get([w.load_checkpoint.remote(str(Path(directory).resolve()), parts["trainer"],
                                          parts.get(f"rng_rank{r}", {}).get("rng"))
                 for r, w in enumerate(self.workers)])

    def save_pretrained(self, path: str | Path, store: CheckpointStore | None = None) -> str:
        """The policy as a transformers directory at `path` in the run directory, written by rank 0 (sharded: every
        rank joins the gather into rank 0's host memory); returns `path`. With a remote `store`
        (`tracking.checkpoint_uri`) the directory is also uploaded to its `final_model/`."""
        path = Path(path).resolve()
        workers = self.workers if shard_mesh(self.cfg) else self.workers[:1]
        ray.get([w.save_pretrained.remote(str(path)) for w in workers])
        if store is not None and store.remote_uri is not None:
            store.upload_dir(path, FINAL_MODEL)
        return str(path)


def shards_unreachable(run_dir: Path, ranks: list[dict[str, Any]], driver_ip: str) -> str:
    """Why a run whose trainer ranks do not all see the driver's run directory is refused."""
    where = ", ".join(sorted({r["ip"] for r in ranks}))
    return (f"trainer ranks on {where} do not see the run directory {run_dir} of the driver on node {driver_ip}: "
            "every rank writes its shards of each checkpoint there. Put job.out_dir on a filesystem every node "
            "mounts at the same path (NFS, Lustre, a shared volume); tracking.checkpoint_uri then mirrors the "
            "checkpoints to S3")

