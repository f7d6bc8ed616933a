"""The reward-model role: frozen reward models (`data.rewards` entries with a `model`) and local generative judges
(entries with a `judge.model`) in Ray actors beside the trainer ranks.

`RewardModelRole` places one `RewardModelWorker` per trainer rank in the trainer ranks' placement group, replica i in
rank i's bundle: on that rank's node and, on GPU, on its GPU (Ray counts `TEACHER_GPU_SHARE` of it per replica and
the rank asks for the rest; the memory plan counts the reward models on the rank). It reserves no CPU: the reward
models score between the rollout and the train phase, while the ranks wait. Each replica loads every reward-model
entry (`rl_core.rewards.model.ModelScorer`, in `model.compute_dtype` on GPU, float32 on CPU). `score(index, inputs)`
cuts a batch into one contiguous share per replica, scores the shares in parallel (each `batch_size` rows per
forward) and returns the raw scores in order; a share not back within `data.reward_timeout_s`, or a replica that
fails, fails the step naming the entry, and the replicas are killed and replaced at the next batch (a retried reward
phase starts on fresh ones). Enter it inside the `Cluster` context (the `RewardPool` does); on exit the replicas are
shut down and killed. A judge (`rl_core.rewards.judge`) answers greedily through its engine (`judge.engine`: HF
over its model, or its own vLLM engine, which on a GPU reserves `judge.gpu_memory_utilization` of the rank's GPU); a
pointwise judge's batch is shared out like a reward model's, a group judge's is judged whole by the first replica (a
group must not be cut), and its counts of unparsable, failed and cached judgements come back with the values.
"""

from __future__ import annotations

import time
from typing import Any, Self

import ray

from infra.processes import use_threads
from infra.workers.actor import BesideRanks, start_beside_ranks
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import reward_model_replicas
from rl_core.rewards import RewardError, RewardInputs
from rl_core.rewards.judge import Judged


class RewardModelWorker:
    """The run's reward models in one actor (an `infra.workers.actor.Actor`). Created as a Ray actor by
    `RewardModelRole`; `models[k]` is `(data.rewards index, absolute path or hub id)`."""

    def __init__(self, cfg_data: dict, models: list[tuple[int, str]], threads: int, gpus: float):
        from infra.workers.actor import actor_device
        from rl_core.config import config_from_dict

        use_threads(threads)
        self.cfg = config_from_dict(cfg_data)
        self.models, self.device = models, actor_device(gpus)
        self.scorers: dict[int, Any] = {}

    def preload(self) -> float:
        t = time.perf_counter()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401

        from rl_core.rewards.model import ModelScorer  # noqa: F401
        return time.perf_counter() - t

    def setup(self) -> list[str]:
        """Load every reward model, frozen; their paths."""
        from rl_core.model.loading import torch_dtype
        from rl_core.rewards.judge import local_judge
        from rl_core.rewards.model import ModelScorer

        name = self.cfg.model.compute_dtype if self.device.type == "cuda" else "float32"
        trust = self.cfg.model.trust_remote_code
        for index, path in self.models:
            entry = self.cfg.data.rewards[index]
            if entry.judge is not None:
                self.scorers[index] = local_judge(entry.judge.model_copy(update={"model": path}), self.device, name,
                                                  trust)
                continue
            self.scorers[index] = ModelScorer(path, data=self.cfg.data, batch_size=entry.batch_size, device=self.device,
                                              dtype=torch_dtype(name), trust_remote_code=trust)
        return [path for _, path in self.models]

    def info(self) -> dict[str, Any]:
        """Where the replica runs and what it serves (`data.rewards[i]`: reward model, or judge on the engine class
        that answers it): the placement report's `reward_models` rows."""
        from infra.workers.actor import node_info

        rewards = self.cfg.data.rewards
        serves = {f"data.rewards[{i}]": "reward model" if rewards[i].judge is None else f"judge on {s.engine}"
                  for i, s in self.scorers.items()}
        return {**node_info(self.device), "serves": serves}

    def score(self, index: int, inputs: RewardInputs) -> Any:
        """A reward model's raw scores; a judge's `Judged`."""
        if self.cfg.data.rewards[index].judge is not None:
            return self.scorers[index].score(inputs.prompts, inputs.completions, inputs.columns.get("answer"))
        return self.scorers[index].score(inputs.prompts, inputs.completions)

    def shutdown(self) -> None:
        self.scorers = {}


class RewardModelRole(BesideRanks):
    """Places the `RewardModelWorker` replicas in the trainer ranks' placement group `trainer_group`
    (`Cluster.trainer_group`; Ray must be initialised: enter it inside `Cluster`)."""

    def __init__(self, cfg: PosttrainConfig, trainer_group: Any):
        from rl_core.model.loading import resolve_model_path
        from rl_core.rewards.model import resolve_reward_model

        self.cfg, self.trainer_group = cfg, trainer_group
        self.models = [(i, resolve_reward_model(e.model, f"data.rewards[{i}].model")) if e.model is not None else
                       (i, resolve_model_path(e.judge.model, f"data.rewards[{i}].judge.model"))
                       for i, e in enumerate(cfg.data.rewards) if e.model is not None or (e.judge and e.judge.model)]

    def __enter__(self) -> Self:
        if reward_model_replicas(self.cfg) < 1 or not self.models:
            raise ValueError("no data.rewards entry names a reward model (model): there is no reward-model role")
        self._start()
        return self

    def _start(self) -> None:
        from infra.workers.actor import worker_config

        c = self.cfg.cluster
        cfg_data, threads = worker_config(self.cfg), max(int(c.cpus_per_worker), 1)
        self.group = start_beside_ranks(self.cfg, "reward_models", RewardModelWorker, reward_model_replicas(self.cfg),
                                        lambda gpus: (cfg_data, self.models, threads, gpus), self.trainer_group,
                                        "reward-model replica(s) (data.rewards' models and local judges)")

    def _replaced(self, problem: str) -> RewardError:
        """Kill the replicas (one may still be busy with the call that timed out, and would hold the next batch
        behind it): the next `score` starts fresh ones. The error to raise."""
        self._kill()
        return RewardError(f"{problem}; its replicas are replaced before the next batch")

    def score(self, index: int, inputs: RewardInputs) -> Any:
        """Entry `index`'s raw score of every completion (a judge's: its `Judged`): one contiguous share per replica,
        in parallel, in order (a group judge's batch whole, on the first replica). After a timeout or a failure the
        replicas are killed, and this call starts new ones."""
        if self.group is None:
            self._start()
        judge = self.cfg.data.rewards[index].judge
        n, actors = len(inputs), self.actors[:1] if judge is not None and judge.mode == "group" else self.actors
        bounds = [round(i * n / len(actors)) for i in range(len(actors) + 1)]
        shares = [(a, bounds[i], bounds[i + 1]) for i, a in enumerate(actors) if bounds[i + 1] > bounds[i]]
        refs = [a.score.remote(index, inputs.part(start, stop)) for a, start, stop in shares]
        timeout, entry = self.cfg.data.reward_timeout_s, f"data.rewards[{index}]"
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            start, stop = next((s[1], s[2]) for s, r in zip(shares, refs, strict=True) if r in pending)
            raise self._replaced(f"the reward model of {entry} did not score completions {start}..{stop - 1} "
                                 f"within data.reward_timeout_s={timeout:g} s (lower its batch_size or raise the "
                                 "timeout)")
        try:
            parts = ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise self._replaced(f"the reward model of {entry} failed to score a batch: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}") from None
        if judge is None:
            return [v for part in parts for v in part]
        return Judged([v for p in parts for v in p.values], sum(p.unparsable for p in parts),
                      sum(p.failed for p in parts), sum(p.cached for p in parts))


__all__ = ["RewardModelRole", "RewardModelWorker"]
