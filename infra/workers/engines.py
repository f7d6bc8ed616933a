"""Rollout engines as Ray actors, and the driver's view of them (`EnginePool`).

`RolloutWorker` (separate placement) is one engine in a Ray actor of its own, on its own CPUs/GPUs
of the engines' placement group: the HF sampling loop over its own copy of the policy, or vLLM
(GPU, or vLLM's CPU build). It joins the weight-sync group of trainer rank 0 and receives every
new policy version there, never through the driver. Colocated engines live inside the trainer
ranks instead (`infra.workers.policy.PolicyWorker`); both answer the same `generate` call.

`EnginePool` is all the driver holds: actor handles. It shards a step's prompts into contiguous
slices (one per engine), gathers the completions in prompt order and joins them. Seeds are per
completion and per prompt position in the step (`rl_core.rollout.seeds.completion_seeds`), so the
completions do not depend on the number of engines.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import ray
import torch

from infra.processes import use_threads
from infra.workers.actor import actor_device, held_weights, node_info
from rl_core.config import PosttrainConfig, config_from_dict
from rl_core.placement.run_shape import tensor_parallel_size
from rl_core.rollout.base import Completions, SamplingParams, concat_completions

WEIGHTS_THREAD = "weights"  # the engine actors' concurrency group of weight syncs, with rollout.in_flight_updates


def build_engine(cfg: PosttrainConfig, device: torch.device, *, model=None, tokenizer=None,
                 max_model_len: int | None = None, sleep_mode: bool = False):
    """The configured engine: HF in `model.compute_dtype`, vLLM in `engine_dtype`.

    HF over `model` (the trainer's own float32 model, colocated and unsharded: it then samples under
    autocast; with LoRA the PEFT model itself) or over a fresh copy of the policy held in the compute dtype
    (with LoRA it receives the merged weights); vLLM from the policy's path, with `model.lora.r > 0` serving
    the adapters it receives as LoRA requests.
    """
    from rl_core.model.loading import load_policy, load_tokenizer, resolve_model_path
    from rl_core.model.lora import adapter_config_dict
    from rl_core.rollout import make_engine

    compute = cfg.model.compute_dtype
    record = cfg.model.routing_replay == "rollout"
    if cfg.rollout.backend == "hf":
        if model is None:
            model, loaded_tokenizer = load_policy(cfg.model, device=device, dtype=compute)
            tokenizer = tokenizer or loaded_tokenizer
        return make_engine(cfg.rollout, model, tokenizer, seed=cfg.sampling_seed, dtype=compute, record_routes=record)
    tokenizer = tokenizer or load_tokenizer(cfg.model)
    path = resolve_model_path(cfg.model.name_or_path)
    lora_config = adapter_config_dict(cfg.model.lora, path) if cfg.model.lora.r > 0 else None
    return make_engine(cfg.rollout, None, tokenizer, seed=cfg.sampling_seed, lora_config=lora_config,
                       model_path=path, dtype=engine_dtype(cfg, device.type == "cuda"),
                       max_model_len=max_model_len, sleep_mode=sleep_mode,
                       trust_remote_code=cfg.model.trust_remote_code,
                       tensor_parallel_size=tensor_parallel_size(cfg), record_routes=record)


def engine_dtype(cfg: PosttrainConfig, on_gpu: bool) -> str:
    """The rollout engines' dtype: `rollout.dtype` for vLLM (auto: bfloat16 on a GPU, never float32 unless asked,
    else `model.compute_dtype`); the HF engine computes in `model.compute_dtype`."""
    if cfg.rollout.backend != "vllm":
        return cfg.model.compute_dtype
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    return "bfloat16" if on_gpu else cfg.model.compute_dtype


class RolloutWorker:
    """One rollout engine in its own Ray actor (separate placement): an `infra.workers.actor.Actor`, started by the run's
    `infra.cluster.placement.Placement` and driven by `Cluster`."""

    def __init__(self, cfg_data: dict, index: int, threads: int, gpus: float):
        use_threads(threads)
        self.cfg = config_from_dict(cfg_data)
        self.index = index
        self.device = actor_device(gpus)
        self.engine = None
        self.group = None
        self.layout = None
        self.max_model_len: int | None = None

    def preload(self) -> float:
        """Import the engine's backend (transformers' model classes, or vLLM), ahead of `setup`: called as the actor
        starts, also before the flow needs it (`infra.cluster.placement.Placement.start_actors_early`). Returns the seconds
        taken."""
        t = time.perf_counter()
        if self.cfg.rollout.backend == "vllm":
            import vllm  # noqa: F401
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
        return time.perf_counter() - t

    def setup(self, max_model_len: int | None) -> int:
        """Build the engine (vLLM sizes its KV cache for `max_model_len`: the longest prompt plus max_tokens)."""
        torch.manual_seed(self.cfg.job.seed)
        self.max_model_len = max_model_len
        self.engine = build_engine(self.cfg, self.device, max_model_len=max_model_len)
        return self.index

    def info(self) -> dict[str, Any]:
        return node_info(self.device)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                 prompt_offset: int) -> tuple[Completions, float]:
        completions = self.engine.generate(prompt_ids, n, sampling, prompt_offset=prompt_offset)
        return completions, self.engine.last_generate_s

    def weight_ranks(self) -> int:
        """The ranks this engine holds in the weight-sync group (`infra.workers.tp_weights.weight_ranks`)."""
        from infra.workers.tp_weights import weight_ranks

        return weight_ranks(tensor_parallel_size(self.cfg), self.cfg.model.lora.r > 0)

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                          layout: list) -> int:
        """Join as group rank `rank`; a tensor-parallel vLLM engine's workers join instead, as ranks `rank` on."""
        from infra.workers import tp_weights
        from infra.workers.distributed import WeightGroup, connect_store, node_ip

        self.layout = layout
        if self.weight_ranks() > 1:
            self.engine.run_in_workers(tp_weights.join, host, port, world_size, rank, backend, node_ip())
        else:
            self.group = WeightGroup(connect_store(host, port, world_size), rank, world_size, backend, node_ip())
        return rank

    def receive_weights(self, version: int) -> dict[str, Any]:
        """Take rank 0's broadcast of `version`, loading each bucket as it arrives; echo the version and the checksum
        of what arrived. With `rollout.in_flight_updates` it runs in the `WEIGHTS_THREAD` group, while a generate
        may be in flight: the HF engine's decoding loop pauses between two steps for the load."""
        from infra.workers import tp_weights
        from infra.workers.distributed import WeightStream, receive_into

        t = time.perf_counter()
        if self.weight_ranks() > 1:  # each tensor-parallel worker receives and loads its slices itself
            received = self.engine.update_weights_in_workers(tp_weights.receive, (self.layout,), version)
            checksum = tp_weights.agreed_checksum(received)
        else:
            stream = WeightStream(self.layout, self.device, group=self.group)
            hf_model = getattr(self.engine, "model", None)
            if hf_model is not None:  # HF: receive straight into the engine's parameters, between two decoding steps
                targets = dict(hf_model.state_dict())
                with self.engine.swap.load():
                    receive_into(stream, targets)
                    self.engine.set_policy_version(version)
            else:
                self.engine.update_weights(stream, version)
                stream.drain()
            checksum = stream.checksum
        return {"version": self.engine.policy_version, "checksum": checksum,
                "held": held_weights(self.engine, self.max_model_len), "seconds": time.perf_counter() - t}

    def shutdown(self) -> None:
        """Leave the weight-sync group."""
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.engine is not None and self.weight_ranks() > 1:
            from infra.workers import tp_weights

            self.engine.run_in_workers(tp_weights.leave)


def shard_sizes(total: int, parts: int) -> list[int]:
    """Contiguous shard sizes of `total` items over `parts` engines (differing by at most one)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class EnginePool:
    """The driver's handle on the rollout engines (actors answering `generate(prompts, n, sampling, offset)`).

    It quacks like a `RolloutEngine` for the rollout and evaluate tasks: `generate(prompt_ids, n,
    sampling)` and `last_generate_s` (the slowest engine's time inside generate: they run in parallel).
    `last_generate_s` is the calling thread's own last call: with `rl.async_steps` a rollout in flight in
    a task thread and an evaluation in the flow's thread call `generate` at the same time.
    """

    def __init__(self, actors: list[Any]):
        if not actors:
            raise ValueError("EnginePool needs at least one engine")
        self.actors = list(actors)
        self._calls = threading.local()

    @property
    def last_generate_s(self) -> float:
        return getattr(self._calls, "generate_s", 0.0)

    def __len__(self) -> int:
        return len(self.actors)

    def lanes(self) -> list[EnginePool]:
        """One pool per engine: what per-episode scheduling (`rl_core.agents.scheduling`) sends requests to."""
        return [EnginePool([actor]) for actor in self.actors]

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        sizes = shard_sizes(len(prompt_ids), len(self.actors))
        calls, offset = [], 0
        for actor, size in zip(self.actors, sizes):
            if size:
                shard = sampling if getattr(sampling, "row_seeds", None) is None else replace(
                    sampling, row_seeds=sampling.row_seeds[offset: offset + size])
                calls.append(actor.generate.remote(prompt_ids[offset: offset + size], n, shard, offset))
            offset += size
        results = ray.get(calls)
        self._calls.generate_s = max(s for _, s in results)
        return concat_completions([c for c, _ in results])
