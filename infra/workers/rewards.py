"""The reward role: the reward functions run in a pool of Ray actors, off the driver process.

`RewardPool` (enter it inside `Cluster`, which joins or starts Ray) places `data.reward_workers` actors (with the
`Cluster`'s placement: those `posttrain run` started ahead, `infra.cluster.placement.Placement.take_helper`);
each imports the configured functions (`rl_core.rewards.configured.reward_functions`: `data.rewards`, or the task's
own). A batch is cut into one contiguous share per actor and every function is called once per share,
all shares at once. Each actor runs its calls in order, so its k-th call must be back within
k · `data.reward_timeout_s` of the batch's start; one that is not is named in the error, and the pool's
actors are replaced before the next batch (a retry of the reward phase starts on fresh actors). With
`data.reward_workers=0` the functions run in the driver process, without a timeout.

The actors reserve no CPU: scoring runs between the rollout and the train phase, when the trainer's and
engines' CPUs are idle.

A `data.rewards` entry that names a reward model (`model`) or a local judge (`judge.model`) is scored by the
reward-model role (`infra.workers.reward_model.RewardModelRole`, its replicas beside the trainer ranks; the pool
enters it when given the trainer ranks' placement group), a reward model's scores then normalised over the whole
batch (`normalize`) before the weighted sum; an endpoint judge is called from this process. A judge's counts of
unparsable, failed and cached judgements are logged beside its mean.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from infra.processes import use_threads
from infra.workers.actor import HelperPool
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import reward_model_replicas
from rl_core.rewards import RewardError, RewardFunction, RewardInputs, Scores, call_reward, scored
from rl_core.rewards.configured import reward_functions as configured_functions
from rl_core.rewards.model import normalized
from rl_core.user_code import user_error


class RewardWorker:
    """The configured reward functions in one Ray actor (an `infra.workers.actor.Actor`). They are imported as the actor
    is constructed, so a function that does not import fails the actor's start."""

    def __init__(self, cfg_data: dict):
        from rl_core.config import config_from_dict

        use_threads(1)  # a reward function's tensor work, if any, is small; the trainer and engines need the cores
        self.functions = configured_functions(config_from_dict(cfg_data).data)

    def preload(self) -> float:
        return 0.0  # the functions were imported by the constructor

    def setup(self) -> list[str]:
        """The functions' names."""
        return [f.name for f in self.functions]

    def info(self) -> dict[str, Any]:
        import torch

        from infra.workers.actor import node_info

        return node_info(torch.device("cpu"))

    def shutdown(self) -> None:
        pass

    def call(self, index: int, inputs: RewardInputs, offset: int) -> list[float | None]:
        return call_reward(self.functions[index], inputs, offset)


class RewardPool(HelperPool):
    """`scores(inputs) -> Scores` (`score(inputs) -> (rewards, per-function means)`) on `data.reward_workers` actors
    (or in this process)."""

    role, worker, what = "rewards", RewardWorker, "reward workers (data.reward_workers)"
    failure, failed = RewardError, "a reward worker failed to start (importing data.rewards / data.task)"

    def __init__(self, cfg: PosttrainConfig, placement: Any = None, trainer_group: Any = None):
        functions: list[RewardFunction] = configured_functions(cfg.data)
        self.called = [i for i, f in enumerate(functions) if f.model is None]  # functions; the rest reward models
        super().__init__(cfg, cfg.data.reward_workers if self.called else 0, placement)
        self.functions, self.trainer_group, self.models = functions, trainer_group, None

    def __enter__(self):
        super().__enter__()
        if reward_model_replicas(self.cfg) and self.trainer_group is not None:
            from infra.workers.reward_model import RewardModelRole

            try:
                self.models = RewardModelRole(self.cfg, self.trainer_group).__enter__()
            except BaseException:
                self._kill()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.models is not None:
                self.models.__exit__(*exc)
        finally:
            self.models = None
            super().__exit__(*exc)

    def node_map(self) -> list[dict[str, Any]]:
        """Where the reward-model replicas run (none without a reward model)."""
        return self.models.node_map() if self.models is not None else []

    def worker_args(self) -> tuple:
        from infra.workers.actor import worker_config

        return (worker_config(self.cfg),)

    def scores(self, inputs: RewardInputs) -> Scores:
        """The batch scored: each completion's reward, each function's mean and each function's own values."""
        per_function: list[list[float | None]] = [[None] * len(inputs) for _ in self.functions]
        if self.called and self.cfg.data.reward_workers == 0:
            for f in self.called:
                per_function[f] = call_reward(self.functions[f], inputs)
        elif self.called:
            per_function = self._score_on_actors(inputs)
        counts: dict[str, float] = {}
        for f, fn in enumerate(self.functions):
            if fn.model is None:
                continue
            judge = fn.model.judge
            if self.models is not None and (judge is None or judge.model is not None):  # placed beside the ranks
                raw = self.models.score(f, inputs)
                per_function[f] = normalized(raw, fn.model.normalize) if judge is None else raw.values
            else:  # an endpoint judge; outside a Cluster, a reward model too: its reward function, in this process
                per_function[f], raw = call_reward(fn, inputs), getattr(fn.fn, "last", None)
            if judge is not None:
                counts.update(raw.metrics(fn.name))
        out = scored(self.functions, per_function, inputs.rows)
        out.means.update(counts)  # a judge's unparsable, failed and cached fractions, beside its mean
        return out

    def score(self, inputs: RewardInputs) -> tuple[list[float], dict[str, float]]:
        out = self.scores(inputs)
        return out.rewards, out.means

    def _score_on_actors(self, inputs: RewardInputs) -> list[list[float | None]]:
        self._place()  # again after a timeout or a failure killed the pool
        n = len(inputs)
        bounds = [round(i * n / len(self.actors)) for i in range(len(self.actors) + 1)]
        shares = [(actor, bounds[i], bounds[i + 1]) for i, actor in enumerate(self.actors) if bounds[i + 1] > bounds[i]]
        calls = {}  # ref -> (function index, share index, position in the actor's queue)
        for s, (actor, start, stop) in enumerate(shares):
            part = ray.put(inputs.part(start, stop))
            for k, f in enumerate(self.called):
                calls[actor.call.remote(f, part, start)] = (f, s, k + 1)
        timeout, began = self.cfg.data.reward_timeout_s, time.monotonic()
        for k in range(1, len(self.called) + 1):  # the k-th call of every actor: back by k timeouts
            kth = [ref for ref, c in calls.items() if c[2] == k]
            _, pending = ray.wait(kth, num_returns=len(kth), timeout=max(began + k * timeout - time.monotonic(), 0))
            if pending:
                f, s, _ = calls[pending[0]]
                start, stop = shares[s][1], shares[s][2]
                self._kill()
                fn = self.functions[f]
                raise RewardError(f"reward {fn.name!r} ({fn.key}) did not return within data.reward_timeout_s="
                                  f"{timeout:g} s on completions {start}..{stop - 1} (the first from "
                                  f"{inputs.rows[start]}); make it faster, or raise data.reward_timeout_s")
        per_function: list[list[float | None]] = [[None] * n for _ in self.functions]
        for ref, (f, s, _) in calls.items():
            start, stop = shares[s][1], shares[s][2]
            failure = self._result(ref, self.functions[f])
            if failure is _DIED:  # which of the worker's calls did not come back: one of them ended its process
                lost = [self.functions[g] for r, (g, t, _) in calls.items() if t == s and _lost(r)]
                self._kill()
                failure = _died(lost, start, stop, inputs)
            if isinstance(failure, RewardError):
                # raised here, outside the except block that caught Ray's error: the RewardError carries neither
                # Ray's error (its remote traceback) nor a dead actor's error as its context, so a dead reward
                # worker is a reward error, never a lost trainer (`flows.restarts.lost_actor`)
                raise failure
            per_function[f][start:start + len(failure)] = failure
        return per_function

    def _result(self, ref: Any, fn: RewardFunction) -> list[float | None] | RewardError | object:
        """The values of one call, the RewardError (not raised) that says why there are none, or `_DIED`."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RewardError):  # `call_reward`'s own error, already described and redacted
                error = RewardError(str(cause))
                error.retryable = getattr(cause, "retryable", True)  # a bug in the function: not retried
                return error
            return RewardError(f"reward {fn.name!r} ({fn.key}) failed in its reward worker: {user_error(cause or exc)}")
        except ray.exceptions.RayActorError:
            return _DIED


_DIED = object()  # `_result`: the call's reward worker died


def _lost(ref: Any) -> bool:
    """Whether the result of `ref` (a call on a worker that died) is gone."""
    try:
        ray.get(ref, timeout=1)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    except ray.exceptions.RayTaskError:  # it came back, as the function's own error
        pass
    return False


def _died(lost: list[RewardFunction], start: int, stop: int, inputs: RewardInputs) -> RewardError:
    names = ", ".join(f"{fn.name!r} ({fn.key})" for fn in lost)  # the call that found the worker dead, at least
    return RewardError(
        f"a reward worker's process ended while scoring completions {start}..{stop - 1} (the first from "
        f"{inputs.rows[start]}), before reward {names} returned: one of them crashed or exited its process (a "
        "segfault, os._exit, sys.exit, out of memory); fix the function (a retry of the reward phase, "
        "job.task_retries, starts on fresh workers)")


__all__ = ["RewardPool", "RewardWorker"]
