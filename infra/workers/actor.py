"""The one protocol of the run's Ray actors, and `ActorGroup`: the driver's owner of one role's actors.

Every role's actor answers the same four calls (`Actor`): a trainer rank (`infra.workers.policy.PolicyWorker`), a
separate rollout engine (`infra.workers.engines.RolloutWorker`), an OPD teacher replica (`infra.workers.teacher.TeacherWorker`) and a
reward worker (`infra.workers.rewards.RewardWorker`). Their constructors keep the config and pick the device, so starting
one does not wait on a model; the model (engine, functions) comes with `setup`.

`ActorGroup` is the driver's side of one role: it requests the role's placement group (or puts the actors into
another role's bundles: the teachers sit in the trainer ranks'), starts the actors (not waited for), waits for their
placement, fans out `preload`, `setup` and `info`, and on `close` shuts the actors down, kills them and frees its
placement group. `infra.cluster.placement.Placement` owns the groups of a run's trainer ranks and engines, and the Ray
they run in. `start_pool` starts the run's helper pools (reward functions, environments; `HelperPool`): actors that
reserve nothing, each built from the run's config.

Actors receive the resolved config as data (`worker_config`): local model paths made absolute by the driver, so they
never re-run a recipe file nor depend on the driver's working directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_core.config import PosttrainConfig
from rl_core.config.loader import config_dict
from rl_core.model.loading import looks_local


@runtime_checkable
class Actor(Protocol):
    """What every role's Ray actor answers."""

    def preload(self) -> float:
        """Import what `setup` needs; the seconds it took. Called right after the actor is started, so its imports
        overlap whatever the driver does until it calls `setup`."""
        ...

    def setup(self, *args: Any) -> Any:
        """Build what the actor serves (model, engine, functions) from the role's arguments."""
        ...

    def info(self) -> dict[str, Any]:
        """Where it runs: node id, ip, pid and device (`node_info` below)."""
        ...

    def shutdown(self) -> None:
        """Release what outlives the process's own exit (process groups); the driver kills the actor next."""
        ...


class PlacementError(RuntimeError):
    """Ray could not place a role within `cluster.placement_timeout_s`."""


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    """One placement-group bundle: CPUs, and GPUs when any."""
    return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}


def describe_resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU", "memory") or k.startswith("accelerator")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "nothing"


class ActorGroup:
    """`count` actors of class `cls` (an `Actor`), actor i built from `args(i)`, each reserving `cpus` and `gpus`.

    Placement: with `bundles`, a placement group of its own (`strategy`), actor i in bundle i; with `host`, another
    group's placement group, actor i in its bundle `bundle_of(i)`; with neither, wherever Ray has room. `options`:
    more Ray actor options (e.g. `max_restarts`).
    """

    def __init__(self, role: str, cls: type, count: int, args: Callable[[int], tuple], *, cpus: float = 0.0,
                 gpus: float = 0.0, bundles: list[dict[str, float]] | None = None, strategy: str = "PACK",
                 host: Any = None, bundle_of: Callable[[int], int] | None = None, options: dict | None = None,
                 concurrency_groups: dict[str, int] | None = None):
        self.role, self.cls, self.count, self.args = role, cls, count, args
        self.concurrency_groups = dict(concurrency_groups or {})
        self.cpus, self.gpus, self.options = cpus, gpus, dict(options or {})
        self.bundles, self.strategy, self.host = bundles, strategy, host
        self.bundle_of = bundle_of or (lambda i: i)
        self.placement_group: Any = None  # its own, when it has bundles
        self.actors: list[Any] = []
        self.placed = False  # the actors hold their resources (their group is ready, or they answered a call)

    # -- start
    def start(self) -> Self:
        """Request the placement group and start the actors in it; nothing is waited for (their processes start
        now). All or nothing: on a failure, what was started is released before the error is raised."""
        try:
            if self.bundles is not None:
                self.placement_group = placement_group(self.bundles, strategy=self.strategy)
            group = self.placement_group if self.bundles is not None else self.host
            remote = ray.remote(concurrency_groups=self.concurrency_groups)(self.cls) if self.concurrency_groups \
                else ray.remote(self.cls)
            for i in range(self.count):
                options = {"num_cpus": self.cpus, "num_gpus": self.gpus, **self.options}
                if group is not None:
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=self.bundle_of(i))
                self.actors.append(remote.options(**options).remote(*self.args(i)))
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    def place(self, timeout: float, what: str, hint: str = "") -> None:
        """Wait for the group's own placement group; PlacementError naming `what` and the request after `timeout`
        seconds (`hint`: what the user may change)."""
        try:
            ray.get(self.placement_group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not place {what} within cluster.placement_timeout_s={timeout:g}: {len(self.bundles)} "
                f"bundle(s) of {self.bundles[0]} with strategy {self.strategy}; available now: "
                f"{describe_resources(ray.available_resources())} of {describe_resources(ray.cluster_resources())}."
                + (f" {hint}" if hint else "")) from None
        self.placed = True

    # -- the protocol, fanned out
    def preload(self) -> list[Any]:
        """Every actor's `preload`, in flight."""
        return [a.preload.remote() for a in self.actors]

    def setup(self, *args: Any) -> list[Any]:
        """Every actor's `setup(*args)`, in flight."""
        return [a.setup.remote(*args) for a in self.actors]

    def wait(self, calls: list[Any], timeout: float | None = None) -> list[Any]:
        """The answers of `calls` to this group's actors (GetTimeoutError after `timeout` s); actors that answer
        are placed."""
        answers = ray.get(calls, timeout=timeout)
        self.placed = True
        return answers

    def info(self) -> list[dict[str, Any]]:
        return ray.get([a.info.remote() for a in self.actors])

    # -- end
    def close(self, graceful: bool = True) -> None:
        """Shut each actor down (`graceful` and placed: its `shutdown`, 10 s at most), kill it, and free the
        placement group. Each step is skipped when it fails (the actor or Ray already gone), so the rest still
        runs."""
        for actor in self.actors:
            if graceful and self.placed:
                with contextlib.suppress(Exception):
                    ray.get(actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
        self.actors, self.placement_group, self.placed = [], None, False


def pool_group(role: str, cls: type, count: int, args: tuple, concurrency: int = 1) -> ActorGroup:
    """A helper pool's group (not started): `count` actors of `cls`, each built from `args`, never restarted, reserving
    nothing; each runs up to `concurrency` calls at once (in threads of its own)."""
    options = {"max_restarts": 0, **({"max_concurrency": concurrency} if concurrency > 1 else {})}
    return ActorGroup(role, cls, count, lambda i: args, options=options)


def start_pool(role: str, cls: type, count: int, args: tuple, *, timeout: float, what: str,
               failure: type[Exception], failed: str, started: ActorGroup | None = None,
               concurrency: int = 1) -> ActorGroup:
    """`count` actors of `cls` (each built from `args`, never restarted) that reserve nothing, started and set up
    within `timeout` seconds (`cluster.placement_timeout_s`): a helper pool of the run (reward functions, environments).
    `started`: the pool's group already started (`Placement.take_helper`), whose setup is waited for instead.
    PlacementError naming `what` after the timeout; `failure(f"{failed}: <why>")` when an actor fails to start.
    Nothing is left running on an error."""
    group = started if started is not None else pool_group(role, cls, count, args, concurrency).start()
    try:
        group.wait(group.setup(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        group.close(graceful=False)
        raise PlacementError(f"Ray could not start the {count} {what} within cluster.placement_timeout_s={timeout:g}; "
                             f"available now: {describe_resources(ray.available_resources())}") from None
    except ray.exceptions.RayActorError as exc:
        group.close(graceful=False)
        raise failure(f"{failed}: {exc}") from None
    return group


class HoldsGroup(AbstractContextManager):
    """What holds one `ActorGroup` (`group`, None until started): its actors, and `_kill`."""

    group: ActorGroup | None = None

    @property
    def actors(self) -> list[Any]:
        return self.group.actors if self.group is not None else []

    def _kill(self, graceful: bool = False) -> None:
        """Close the group: kill the actors (without `graceful`, no `shutdown` call: one may be stuck in a call that
        timed out); the next start places new ones."""
        if self.group is not None:
            self.group.close(graceful=graceful)
        self.group = None


class HelperPool(HoldsGroup):
    """A run's helper pool (`start_pool`) of `count` actors of `worker` built from `worker_args()`: placed when
    entered (and again on the next use after `_kill`), killed on exit; `count=0` places none (the caller then works
    in its own process). With the run's `placement` (`infra.cluster.placement.Placement`), the first placing takes the
    pool's actors that `posttrain run` started ahead (`Placement.take_helper`), when their arguments are the same.
    Subclasses name the role (`role`, `what`), the error of a failed start (`failure`, `failed`) and how many calls an
    actor runs at once (`concurrency`)."""

    role: str
    worker: type
    what: str
    failure: type[Exception]
    failed: str
    concurrency: int = 1

    def __init__(self, cfg: Any, count: int, placement: Any = None):
        self.cfg, self.count, self.placement = cfg, count, placement

    def __enter__(self) -> Self:
        self._place()
        return self

    def __exit__(self, *exc: object) -> None:
        self._kill()

    def worker_args(self) -> tuple:
        raise NotImplementedError

    def _place(self) -> None:
        if self.count == 0 or self.actors:
            return
        args = self.worker_args()
        ahead = self.placement.take_helper(self.role, args) if self.placement is not None else None
        self.group = start_pool(self.role, self.worker, self.count, args, timeout=self.cfg.cluster.placement_timeout_s,
                                what=self.what, failure=self.failure, failed=self.failed, started=ahead,
                                concurrency=self.concurrency)


class BesideRanks(HoldsGroup):
    """A role whose replicas sit in the trainer ranks' bundles (`start_beside_ranks`): its actors, where they run,
    and their shutdown on exit. Subclasses start `self.group` in `__enter__`."""

    def node_map(self) -> list[dict[str, Any]]:
        """Where each replica runs: node id, ip, pid and device."""
        return self.group.info()

    def __exit__(self, *exc: object) -> None:
        self._kill(graceful=True)


def start_beside_ranks(cfg: Any, name: str, cls: type, replicas: int, args: Callable[[float], tuple],
                       trainer_group: Any, what: str) -> ActorGroup:
    """`replicas` actors of `cls` in the trainer ranks' placement group `trainer_group`, replica i in rank
    i % `cluster.num_workers`'s bundle (its node, and on GPU a `TEACHER_GPU_SHARE` of its GPU), built from
    `args(gpus)`, started, preloaded and set up. PlacementError naming `what` when Ray cannot place them within
    `cluster.placement_timeout_s`; on any failure the group is closed."""
    from rl_core.placement.run_shape import TEACHER_GPU_SHARE

    c = cfg.cluster
    if trainer_group is None:
        raise ValueError(f"the {what} join the trainer ranks' placement group: enter the role inside a Cluster and "
                         "pass its trainer_group")
    gpus = TEACHER_GPU_SHARE if c.gpus_per_worker > 0 else 0.0
    group = ActorGroup(name, cls, replicas, lambda i: args(gpus), gpus=gpus, host=trainer_group,
                       bundle_of=lambda i: i % c.num_workers)
    try:
        group.start().preload()
        try:
            group.wait(group.setup(), timeout=c.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not place the {replicas} {what} (0 CPU, {gpus:g} GPU each, in the trainer ranks' bundles) "
                f"within cluster.placement_timeout_s={c.placement_timeout_s:g}; available now: "
                f"{describe_resources(ray.available_resources())}. A replica shares its trainer rank's bundle: the "
                "rank must leave it that share") from None
    except BaseException:
        group.close()
        raise
    return group


# ------------------------------------------------------------------------------------------ shared by the actors


def actor_device(gpus: float) -> torch.device:
    """The device of an actor that reserved `gpus` GPUs: Ray makes them cuda:0.. of the actor."""
    if gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"this actor reserved {gpus:g} GPU(s) but torch sees no CUDA device on node "
                               f"{os.uname().nodename}")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def held_weights(engine, max_model_len: int | None) -> dict:
    """What `engine` holds after a load (`rl_core.rollout.verify`), with the probe over its tokenizer's vocabulary
    (at most the engines' `max_model_len` tokens)."""
    from rl_core.rollout.verify import probe_ids

    return engine.held_weights(probe_ids(len(engine.tokenizer), max_model_len))


def node_info(device: torch.device) -> dict[str, Any]:
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "device": str(device)}


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


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it (through dicts, lists and tuples) detached and copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
