"""The environment role: an agent task's environments (and the tools they call) in a pool of Ray actors.

`EnvironmentPool` (enter it inside `Cluster`, which joins or starts Ray) places `data.env_workers` actors; each
imports the task's `Environment` subclass (`data.task`) and keeps the environments of its share of a rollout's
episodes (`rl_core.agents.host.LocalEnvironments`). A rollout's episodes are dealt to the actors in turn; each call
of the rollout (open, respond to a turn, finish) goes to every actor at once, one batch per actor, and an actor
must answer within `data.env_timeout_s`. Scheduled per episode (`rollout.episode_scheduling`), each episode's
`respond` is a call of its own, from a thread of the driver's, and an actor runs up to `concurrency` of them at once
(one thread each: a tool that sleeps or waits on I/O holds back only its own episode). One that does not (a tool that hangs, an environment that loops) is
killed: the episodes it held end there, counted as environment errors, with reward 0; the other actors' episodes
go on. A new actor takes its place once no rollout is in flight. With `data.env_workers=0` the environments live
in the driver process, without a timeout.

The actors reserve no CPU: environments answer between engine calls, when the engines wait.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import ray

from infra.processes import use_threads
from infra.workers.actor import HelperPool
from rl_core.agents.host import Answer, LocalEnvironments, Opening
from rl_core.agents.rollout import EnvironmentFailure
from rl_core.config import PosttrainConfig
from rl_core.evaluation.heldout import EVALUATION_BATCH


class EnvironmentWorker:
    """The environments of a share of the episodes, in one Ray actor (an `infra.workers.actor.Actor`). The task's
    environment class is imported as the actor is constructed, so one that does not import fails the start."""

    def __init__(self, cfg_data: dict):
        from rl_core.config import config_from_dict
        from rl_core.tasks import get_task
        from rl_core.tasks.environment import configure_environment

        use_threads(1)
        cfg = config_from_dict(cfg_data)
        self.environment = get_task(cfg.data.task).environment
        configure_environment(self.environment, cfg.rollout)
        self.envs = LocalEnvironments()
        # the tools' schemas come from transformers: imported now, while `setup` is awaited, not by the first
        # `open`, which data.env_timeout_s bounds
        from transformers.utils import get_json_schema  # noqa: F401

    def preload(self) -> float:
        return 0.0  # the environment and the schema builder were imported by the constructor

    def setup(self) -> str:
        return self.environment.__name__

    def info(self) -> dict[str, Any]:
        import torch

        from infra.workers.actor import node_info

        return node_info(torch.device("cpu"))

    def shutdown(self) -> None:
        pass

    def open(self, items: list[tuple[Hashable, Any]]) -> list[Opening]:
        return self.envs.open(self.environment, items)

    def respond(self, items: list) -> list[Answer]:
        return self.envs.respond(items)

    def finish(self, items: list[tuple[Hashable, None]]) -> list[Answer]:
        return self.envs.finish([key for key, _ in items])

    def discard(self, keys: list[Hashable]) -> None:
        self.envs.discard(keys)


MAX_CONCURRENCY = 256  # threads of one environment actor


class EnvironmentPool(HelperPool):
    """The host of an agent task's environments (`rl_core.agents.host`) on `data.env_workers` actors, or in this
    process (`LocalEnvironments`) with `data.env_workers=0`."""

    role, worker, what = "environments", EnvironmentWorker, "environment workers (data.env_workers)"
    failure, failed = EnvironmentFailure, "an environment worker failed to start (importing data.task)"

    def __init__(self, cfg: PosttrainConfig):
        super().__init__(cfg, cfg.data.env_workers)
        # calls at once per actor: a step's episodes (or an evaluation's chunk of 128) dealt over the actors
        episodes = max(cfg.rollout.prompts_per_step * cfg.rollout.n, EVALUATION_BATCH)
        self.concurrency = min(MAX_CONCURRENCY, math.ceil(episodes / max(1, cfg.data.env_workers)))
        self._lock = threading.Lock()  # `where`, `lost` and `dead`, from the rollout's threads
        self.local = LocalEnvironments() if cfg.data.env_workers == 0 else None
        if self.local is not None:  # the environments are the driver's: the task's class, as the rollout gets it
            from rl_core.tasks import get_task
            from rl_core.tasks.environment import configure_environment

            configure_environment(get_task(cfg.data.task).environment, cfg.rollout)
        self.where: dict[Hashable, int] = {}  # episode key -> the actor holding its environment
        self.lost: dict[Hashable, str] = {}  # episode key -> why its environment is gone
        self.dead: set[int] = set()  # actors killed after a timeout or a crash

    # -- the actors
    def worker_args(self) -> tuple:
        from infra.workers.actor import worker_config

        return (worker_config(self.cfg),)

    def _kill(self, graceful: bool = False) -> None:
        super()._kill(graceful)
        self.dead = set()
        self.where.clear()
        self.lost.clear()

    def _lose(self, actor: int, why: str) -> None:
        with self._lock:
            if actor in self.dead:
                return
            self.dead.add(actor)
            for key, at in self.where.items():
                if at == actor:
                    self.lost.setdefault(key, why)
        ray.kill(self.actors[actor], no_restart=True)

    # -- the host's calls (rl_core.agents.host)
    def open(self, environment: type, items: Sequence[tuple[Hashable, Any]]) -> list[Opening]:
        """Start the episodes `items` on the actors, dealt in turn (`environment` is the configured task's, which
        every actor imported)."""
        if self.local is not None:
            return self.local.open(environment, items)
        if self.dead and not self.where:  # no rollout in flight: replace the actors lost to a timeout
            self._kill()
        self._place()
        healthy = [a for a in range(len(self.actors)) if a not in self.dead]
        if not healthy:
            raise EnvironmentFailure("every environment worker was lost to a timeout or a crash during this "
                                     "rollout; see the errors above")
        for i, (key, _) in enumerate(items):
            self.where[key] = healthy[i % len(healthy)]
        return self._call("open", list(items), lambda why: Opening(error=why))

    def respond(self, items: Sequence[tuple[Hashable, Any]]) -> list[Answer]:
        if self.local is not None:
            return self.local.respond(items)
        return self._call("respond", list(items), lambda why: Answer(error=why, lost=True))

    def finish(self, keys: Sequence[Hashable]) -> list[Answer]:
        if self.local is not None:
            return self.local.finish(keys)
        try:
            return self._call("finish", [(key, None) for key in keys], lambda why: Answer(error=why, lost=True))
        finally:
            self._forget(keys)

    def discard(self, keys: Sequence[Hashable]) -> None:
        if self.local is not None:
            return self.local.discard(keys)
        by_actor: dict[int, list] = {}
        for key in keys:
            if key in self.where and key not in self.lost:
                by_actor.setdefault(self.where[key], []).append(key)
        for a, share in by_actor.items():
            self.actors[a].discard.remote(share)  # not waited for: the actor may be the reason of the failure
        self._forget(keys)

    def _forget(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self.where.pop(key, None)
            self.lost.pop(key, None)

    def _call(self, method: str, items: list[tuple[Hashable, Any]], lost: Any) -> list[Any]:
        """`method` of each item's actor, one batch per actor, all at once; an actor that does not answer within
        `data.env_timeout_s`, or dies, is killed and its episodes are lost (`lost(why)` is their answer)."""
        out: list[Any] = [None] * len(items)
        by_actor: dict[int, list[int]] = {}
        with self._lock:
            for i, (key, _) in enumerate(items):
                if key in self.lost:
                    out[i] = lost(self.lost[key])
                else:
                    by_actor.setdefault(self.where[key], []).append(i)
        calls = {}
        for a, positions in by_actor.items():
            calls[getattr(self.actors[a], method).remote([items[i] for i in positions])] = (a, positions)
        timeout = self.cfg.data.env_timeout_s
        ready, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        for ref in pending:
            a, positions = calls[ref]
            self._lose(a, f"the environment did not answer ({method}) within data.env_timeout_s={timeout:g} s on "
                          f"its worker, which was killed with the {sum(1 for at in self.where.values() if at == a)} "
                          "episode(s) it held; make the environment or its tools faster, or raise "
                          "data.env_timeout_s")
        for ref in ready:
            a, positions = calls[ref]
            try:
                answers = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                self._lose(a, f"the environment worker died during {method} ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); the environment or a tool crashed "
                              "its process")
                continue
            for i, answer in zip(positions, answers, strict=True):
                out[i] = answer
        for i, (key, _) in enumerate(items):
            if out[i] is None:
                out[i] = lost(self.lost[key])
        return out
