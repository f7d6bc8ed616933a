"""`Placement`: the driver's owner of a run's Ray and of its trainer ranks' and rollout engines' actor groups.

It joins or starts Ray (`infra.cluster.ray_connect`), starts each role's `ActorGroup` (infra/workers/actor.py) when it is first
asked for, and on `close` shuts the groups down and stops a Ray it started. `infra.cluster.cluster.Cluster` places, sets up
and drives the groups of its `Placement`.

Early start (`posttrain run`, flows/entry.py): the entry creates the run's `Placement` before the flow exists, starts
the local Ray in it (`start_ray_early`) and the trainer ranks' and separate engines' groups with their `preload`
(`start_actors_early`), and the reward workers' actors (`data.reward_workers`), which import the reward functions
while the flow starts, until the flow's `infra.workers.rewards.RewardPool` takes them (`take_helper`); all while Prefect's API
starts. Then it offers the placement (`offered()`) for as long as the flow runs. The flow's `Cluster` takes the offered placement over (`take_offered`): it uses those very actors when
its worker config is the same, and with another config discards them and starts its own, keeping the Ray. Whoever
holds the placement last closes it: the `Cluster` on its exit, or the entry when the flow failed before placing
anything.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import ClassVar

import ray

from infra.cluster.ray_connect import connect_ray, start_local_ray
from infra.workers.actor import ActorGroup, bundle, pool_group, worker_config
from infra.workers.engines import WEIGHTS_THREAD, RolloutWorker
from infra.workers.policy import PolicyWorker
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import num_engines, trainer_gpus


def worker_bundles(cfg: PosttrainConfig) -> list[dict[str, float]]:
    """The trainer ranks' placement-group bundles: one per rank (OPD: its teacher replicas share it,
    infra/workers/teacher.py)."""
    return [bundle(cfg.cluster.cpus_per_worker, cfg.cluster.gpus_per_worker)] * cfg.cluster.num_workers


def engine_bundles(cfg: PosttrainConfig) -> list[dict[str, float]]:
    """The separate rollout engines' placement-group bundles: one per engine."""
    return [bundle(cfg.cluster.cpus_per_engine, cfg.cluster.gpus_per_engine)] * num_engines(cfg)


def trainer_group(cfg: PosttrainConfig, worker_cfg: dict) -> ActorGroup:
    """The trainer ranks (not started): one `PolicyWorker` per bundle of their own placement group, each asking for
    its bundle's GPUs less its OPD teachers' share (`trainer_gpus`)."""
    c = cfg.cluster
    return ActorGroup("trainers", PolicyWorker, c.num_workers,
                      lambda r: (worker_cfg, r, c.num_workers, max(int(c.cpus_per_worker), 1), c.gpus_per_worker),
                      cpus=c.cpus_per_worker, gpus=trainer_gpus(cfg), bundles=worker_bundles(cfg),
                      strategy=c.placement_strategy)


def engine_group(cfg: PosttrainConfig, worker_cfg: dict) -> ActorGroup:
    """The separate rollout engines (not started): one `RolloutWorker` per bundle of their own placement group. With
    `rollout.in_flight_updates` a weight sync runs in a thread of its own ("weights"), beside the generate in flight."""
    c = cfg.cluster
    return ActorGroup("engines", RolloutWorker, num_engines(cfg),
                      lambda i: (worker_cfg, i, max(int(c.cpus_per_engine), 1), c.gpus_per_engine),
                      cpus=c.cpus_per_engine, gpus=c.gpus_per_engine, bundles=engine_bundles(cfg), strategy="PACK",
                      concurrency_groups={WEIGHTS_THREAD: 1} if cfg.rollout.in_flight_updates else None)


ROLES = {"trainers": trainer_group, "engines": engine_group}


class Placement:
    """A run's Ray (joined, or started by this object) and its actor groups by role ("trainers", "engines")."""

    _offered: ClassVar[Placement | None] = None  # the placement `offered()` hands to the next Cluster

    def __init__(self, cfg: PosttrainConfig):
        self.cfg = cfg
        self.worker_cfg = worker_config(cfg)
        self.groups: dict[str, ActorGroup] = {}
        self.helpers: dict[str, tuple[tuple, ActorGroup]] = {}  # helper pool role -> (its actors' args, its group)
        self.started_ray = False  # this object started the Ray it uses: `close` stops it

    # -- early start (posttrain run)
    def start_ray_early(self) -> bool:
        """Start now the local Ray that `connect` would start later (call it from the main thread: Ray's processes
        die with the thread that started them); False when `connect` would join a cluster or use a Ray already
        up."""
        if ray.is_initialized() or self.cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
            return False
        start_local_ray(self.cfg)
        self.started_ray = True
        return True

    def start_actors_early(self) -> int:
        """Start the trainer ranks' group, and with `cluster.placement=separate` the engines', and have each actor
        import what its `setup` needs (`preload`), with Ray up; and start the reward workers (their constructors import
        the reward functions). All or nothing: on a failure, the groups are released before the error is raised.
        Returns the number of actors started."""
        # the reward role's module, here: needed only for an early start
        from infra.workers.rewards import RewardWorker

        roles = ["trainers"] + (["engines"] if self.cfg.cluster.placement == "separate" else [])
        try:
            for role in roles:
                self.group(role).preload()
            if self.cfg.data.reward_workers:
                args = (self.worker_cfg,)  # infra.workers.rewards.RewardPool.worker_args
                self.helpers["rewards"] = (args, pool_group("rewards", RewardWorker, self.cfg.data.reward_workers,
                                                            args).start())
        except BaseException:
            self.discard_groups()
            raise
        return sum(len(self.groups[role].actors) for role in roles) + sum(
            len(group.actors) for _, group in self.helpers.values())

    def take_helper(self, role: str, args: tuple) -> ActorGroup | None:
        """The helper pool `role`'s group started ahead (not yet set up), handed over once: the pool then owns it.
        None when none was started, or when it was started with other arguments (it is killed); the arguments are the
        run's worker config, which holds the pool's size too."""
        args_ahead, group = self.helpers.pop(role, (None, None))
        if group is not None and args_ahead != args:
            group.close(graceful=False)
            group = None
        return group

    @contextlib.contextmanager
    def offered(self) -> Iterator[Placement]:
        """Offer this placement to the next `Cluster` for the duration of the block (`take_offered`)."""
        Placement._offered = self
        try:
            yield self
        finally:
            if Placement._offered is self:
                Placement._offered = None

    @classmethod
    def take_offered(cls, cfg: PosttrainConfig) -> Placement | None:
        """The offered placement, handed over once and made `cfg`'s: its groups started for another worker config
        are discarded (its Ray stays); None when none is offered."""
        placement, cls._offered = cls._offered, None
        if placement is not None and placement.worker_cfg != worker_config(cfg):
            placement.discard_groups()
            placement.cfg, placement.worker_cfg = cfg, worker_config(cfg)
        elif placement is not None:
            placement.cfg = cfg
        return placement

    # -- the run's
    def connect(self) -> None:
        """Join `cluster.address` / RAY_ADDRESS, or start a local Ray (`infra.cluster.ray_connect.connect_ray`), unless this
        object's own Ray is up already."""
        if not (self.started_ray and ray.is_initialized()):
            self.started_ray = connect_ray(self.cfg)

    def group(self, role: str) -> ActorGroup:
        """The started group of `role`: the one started early, else one started now."""
        if role not in self.groups:
            self.groups[role] = ROLES[role](self.cfg, self.worker_cfg).start()
        return self.groups[role]

    def discard_groups(self) -> None:
        """Kill the groups' actors (and the helper pools' not taken) and free their placement groups (actors that were
        never set up)."""
        for group in [*self.groups.values(), *(group for _, group in self.helpers.values())]:
            group.close(graceful=False)
        self.groups, self.helpers = {}, {}

    def close(self) -> None:
        """Shut down and kill every group's actors (the last started first), free their placement groups, and stop
        a Ray this object started."""
        for _, group in self.helpers.values():  # never set up: nothing to shut down
            group.close(graceful=False)
        for role in reversed(list(self.groups)):
            self.groups[role].close()
        self.groups, self.helpers = {}, {}
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False
