"""One data-parallel trainer rank as a Ray actor (`PolicyWorker`).

`Cluster` (infra/cluster/cluster.py) places these actors, each built from the resolved config as data
(`infra.workers.actor.worker_config`); each rank builds its trainer (`infra.workers.trainer_build.build_trainer`:
policy, frozen reference when the objective needs one, the objective from the registry, `LLMTrainer`) and, with PPO,
its critic (`infra.workers.critic`), joins the data-parallel process group, and, colocated, hosts its rollout engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from infra.processes import use_threads
from infra.workers.actor import actor_device, held_weights, node_info, to_cpu
from infra.workers.critic import CRITIC, RankCritic
from infra.workers.engines import build_engine, engine_dtype
from infra.workers.trainer_build import build_trainer
from rl_core.config import config_from_dict
from rl_core.model.loading import matmul_precision_kept
from rl_core.placement.run_shape import mini_batch_rows


class PolicyWorker:
    """One data-parallel trainer rank (and, colocated, its rollout engine): an `infra.workers.actor.Actor`, started by the
    run's `infra.cluster.placement.Placement` and driven by `Cluster`."""

    def __init__(self, cfg_data: dict, rank: int, world_size: int, threads: int, gpus: float):
        use_threads(threads)
        self.cfg = config_from_dict(cfg_data)
        self.rank, self.world_size = rank, world_size
        self.device = actor_device(gpus)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.trainer = self.tokenizer = self.engine = None
        self.critic: RankCritic | None = None
        self._store = self._weight_store = self.weight_group = None
        self._checkpoint_group: Any = None  # a CPU (gloo) group of the trainer ranks, for checkpoints alone
        self._writing: Any = None  # the future of the checkpoint being written (`start_checkpoint`)
        self.max_model_len: int | None = None
        self.layout: list | None = None

    def preload(self) -> float:
        """Import what `setup` uses (transformers' model classes take seconds), ahead of it: called as the actor
        starts, also before the flow needs it (`infra.cluster.placement.Placement.start_actors_early`). Returns the seconds
        taken."""
        t = time.perf_counter()
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

        import rl_core.training.trainer  # noqa: F401
        from rl_core.model.loading import load_policy  # noqa: F401
        return time.perf_counter() - t

    def info(self) -> dict[str, Any]:
        """Where the rank runs, its float32 matmul precision as training uses it (after a colocated engine started:
        "high", TF32, on CUDA), and what a colocated vLLM engine keeps on the GPU while it sleeps (its CUDA graphs
        and buffers, measured as it started; the memory plan's `vllm_asleep_bytes`)."""
        out = {**node_info(self.device), "float32_matmul_precision": torch.get_float32_matmul_precision()}
        resident = getattr(self.engine, "asleep_resident_bytes", None)
        if resident is not None:
            out["vllm_asleep_resident_gib"] = round(resident / 2**30, 3)
        return out

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: a TCP store on this node for the data-parallel group; `(node ip, port)`."""
        from infra.workers.distributed import node_ip, open_store

        ip = node_ip()
        self._store, port = open_store(ip, self.world_size)
        return ip, port

    def setup(self, host: str | None, port: int | None, max_model_len: int | None) -> int:
        """Join the data-parallel group (world > 1), build model, objective and trainer, and the colocated engine."""
        from infra.workers.distributed import connect_store, init_default_group, node_ip
        from rl_core.training.data_parallel import ProcessGroupReducer

        self.max_model_len = max_model_len  # also the length limit of the sync's probe (rl_core.rollout.verify)
        reducer = None
        if self.world_size > 1:
            store = self._store or connect_store(host, port, self.world_size)
            init_default_group(self.backend, store, self.rank, self.world_size, node_ip())
            reducer = ProcessGroupReducer()
            import torch.distributed as dist

            # the checkpoint's collectives run in a background thread while training's run: a group of their own
            self._checkpoint_group = dist.new_group(backend="gloo")
        self.trainer, self.tokenizer = build_trainer(self.cfg, reducer, self.device)
        if self.cfg.rl.objective.has_critic:
            self.critic = RankCritic(self.cfg, reducer, self.device, self.trainer)
        if self.cfg.cluster.placement == "colocated" and self.cfg.rl.objective.trains_policy:
            # a sharded trainer model cannot generate alone (its forwards are collectives): the engine gets a copy
            shared = None if self.trainer.sharded else self.trainer.model
            from infra.workers.distributed import outside_default_group

            # in-process vLLM: a world of its own, off the trainers' group; the trainer's TF32 setting kept
            with outside_default_group(), matmul_precision_kept():
                self.engine = build_engine(self.cfg, self.device, model=shared, tokenizer=self.tokenizer,
                                           max_model_len=max_model_len, sleep_mode=True)
            if self.cfg.rollout.backend == "vllm" and self.world_size > 1:
                self._check_engine_world()
        return self.rank

    def _check_engine_world(self) -> None:
        """The in-process vLLM's world is its own one process, and the default group is still the trainers'."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group

        engine_world, trainers = get_world_group().world_size, dist.get_world_size()
        if engine_world != 1 or trainers != self.world_size:
            raise RuntimeError(f"trainer rank {self.rank}: the colocated vLLM engine's world has {engine_world} "
                               f"process(es) and the default group {trainers} (the trainers are {self.world_size}): "
                               "vLLM took the trainers' process group; use cluster.placement=separate")

    # -- rollout (colocated)
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Any, prompt_offset: int) -> tuple[Any, float]:
        completions = self.engine.generate(prompt_ids, n, sampling, prompt_offset=prompt_offset)
        return completions, self.engine.last_generate_s

    def sync_colocated(self, version: int) -> dict[str, Any]:
        """Hand this rank's weights to its own engine (HF: it samples from them already); echo version, checksum and
        what the engine holds, and (rank 0) what the trainer expects it to hold.

        A vLLM engine reloads from a stream: each tensor is gathered (sharded), cast to the engine's dtype and packed
        into a bucket as vLLM's loader asks for it, so the rank never holds a second full copy of the model."""
        from infra.workers.distributed import WeightStream
        from rl_core.rollout.verify import summed, tensor_sums

        t = time.perf_counter()
        layout = self.weight_layout()
        if getattr(self.engine, "model", None) is self.trainer.model:
            state = self.trainer.model.state_dict()
            self.engine.set_policy_version(version)
            stream = WeightStream(layout, self.device, source=state.items()).drain()
            sums = tensor_sums(state)
        else:
            state = self._lora_state(self._wire_dtype())
            source = self.trainer.iter_full_model_state() if state is None else state.items()
            stream = WeightStream(layout, self.device, source=source)
            sums = {}
            tap = summed(stream, sums)
            self.engine.update_weights(tap, version)
            for _ in tap:  # whatever the engine did not ask for: the gathers are collectives
                pass
        held = held_weights(self.engine, self.max_model_len)
        return {"version": self.engine.policy_version, "checksum": stream.checksum, "held": held,
                "expected": self._expected(sums), "seconds": time.perf_counter() - t, "bytes": 0}

    def _expected(self, sums: dict[str, tuple[float, float]] | None) -> dict[str, Any] | None:
        """What an engine should hold after a sync (`rl_core.rollout.verify`): `sums` of the tensors it was sent (as
        sent) and the trainer's own log-probs of the probe. Sharded, every rank runs the probe's forward (a
        collective); rank 0 reports."""
        from rl_core.rollout.verify import probe_ids, probe_logprobs

        if self.rank != 0 and not self.trainer.sharded:
            return None
        with self.trainer.autocast():
            logp = probe_logprobs(self.trainer.model, probe_ids(len(self.tokenizer), self.max_model_len))
        if self.rank != 0:
            return None
        return {"sums": sums, "probe_logp": logp, "dtype": self._engine_dtype()}

    def _lora_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
        """With LoRA, what the engines take: the adapters (vLLM loads them as a LoRA request) or the merged
        weights (an HF engine of its own); None without LoRA or for a colocated HF engine, which samples from
        the trainer's PEFT model itself."""
        from rl_core.model import lora

        model = self.trainer.model
        if not lora.is_lora(model) or getattr(self.engine, "model", None) is model:
            return None
        if self.cfg.rollout.backend == "vllm":
            return lora.adapter_state(model, dtype)
        return lora.merged_state(model, dtype)

    def _wire_dtype(self) -> torch.dtype:
        from rl_core.model.loading import torch_dtype

        return torch_dtype(self._engine_dtype())

    def _engine_dtype(self) -> str:
        """The engines' dtype, which the weights are cast to before they leave this rank."""
        on_gpu = self.device.type == "cuda" if self.cfg.cluster.placement == "colocated" \
            else self.cfg.cluster.gpus_per_engine > 0
        return engine_dtype(self.cfg, on_gpu)

    # -- weight sync to separate engines (rank 0)
    def weight_layout(self) -> list:
        from infra.workers.distributed import wire_layout

        if self.layout is None:
            state = self._lora_state()
            self.layout = wire_layout(self.trainer.model.state_dict() if state is None else state, self._engine_dtype())
        return self.layout

    def open_weight_group(self, world_size: int) -> tuple[str, int]:
        from infra.workers.distributed import node_ip, open_store

        ip = node_ip()
        self._weight_store, port = open_store(ip, world_size)
        return ip, port

    def join_weight_group(self, world_size: int) -> int:
        from infra.workers.distributed import WeightGroup, node_ip

        self.weight_group = WeightGroup(self._weight_store, 0, world_size, self.backend, node_ip())
        return 0

    def broadcast_weights(self, version: int) -> dict[str, Any] | None:
        """Rank 0 sends the weights to the engines, one bucket at a time; when sharded every rank calls this (each
        tensor's gather is a collective) and only rank 0 keeps what it gathers, for as long as its bucket is packed."""
        from infra.workers.distributed import WeightStream
        from rl_core.rollout.verify import tensor_sums

        t = time.perf_counter()
        state = self._lora_state()
        if state is not None:
            source = state.items()
        elif self.trainer.sharded:
            source = self.trainer.iter_full_model_state()
        else:
            source = self.trainer.model.state_dict().items()
        if self.rank != 0:
            for _ in source:  # sharded: take part in each gather, keep nothing
                pass
            self._expected(None)  # sharded: the probe's forward is a collective
            return None
        stream = WeightStream(self.weight_layout(), self.device, group=self.weight_group, source=source)
        sums = tensor_sums(stream)
        return {"version": int(version), "checksum": stream.checksum, "bytes": stream.bytes,
                "seconds": time.perf_counter() - t, "expected": self._expected(sums)}

    # -- training
    def train_step(self, shard: Any) -> dict[str, float]:
        """One train step on this rank's shard. On GPU also `perf/gpu_rollout_used_gib` (device memory in use
        before the step: the trainer plus an awake colocated engine), `perf/gpu_asleep_used_gib` (in use once a
        colocated engine sleeps) and `perf/gpu_train_peak_gib` (torch's peak allocation during the step)."""
        gpu = self.device.type == "cuda"
        if gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            rollout_used = (total - free) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.engine is not None:
            self.engine.sleep()  # colocated vLLM on GPU: free its memory for the step
        if gpu:
            free, total = torch.cuda.mem_get_info(self.device)
            asleep_used = (total - free) / 2**30
        t0 = time.perf_counter()
        rl = self.cfg.rl
        mini = mini_batch_rows(self.cfg, shard.batch_size)
        sizes = (rl.micro_batch_per_replica, mini, rl.micro_batch_max_tokens)
        metrics, warming = {}, False
        if self.critic is not None:  # PPO: the critic's step first; in its warm-up the policy stays as it is
            metrics = self.critic.train_step(shard, *sizes)
            warming = self.trainer.policy_version < rl.objective.critic_warmup_steps
        if warming:
            self.trainer.skip_batch()
        else:
            metrics.update(self.trainer.train_step(shard, *sizes))
            self.trainer.release_gradients()  # not needed until the next step: frees memory for the rollout
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["perf/train_compute_s"] = time.perf_counter() - t0
        if gpu:
            metrics["perf/gpu_rollout_used_gib"] = rollout_used
            metrics["perf/gpu_asleep_used_gib"] = asleep_used
            metrics["perf/gpu_train_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def values(self, shard: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """PPO: the critic's values of this rank's rows (and the reference's log-probs with a KL in the reward)."""
        if self.engine is not None:
            self.engine.sleep()
        return self.critic.values(shard)

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
        from rl_core.model import lora
        from rl_core.model.loading import load_policy

        model_cfg = self.cfg.model if self.cfg.rl.reference is None else \
            self.cfg.model.model_copy(update={"name_or_path": self.cfg.rl.reference})
        if lora.is_lora(self.trainer.model) and self.cfg.rl.reference is None:  # the base, adapter disabled
            reference = lora.ReferenceView(self.trainer.model)
        else:
            reference, _ = load_policy(model_cfg, device=self.device, dtype=self.cfg.model.compute_dtype)
        with self.trainer.autocast():
            scored = with_reference_logps(reference, batch.to(self.device), temperature=self.cfg.rollout.temperature,
                                          micro_batch_size=micro_batch_size)
        return scored.ref_logp.cpu()

    # -- checkpoints
    def start_checkpoint(self, directory: str) -> dict[str, Any]:
        """Start writing this rank's shards of model and optimizer into `directory` (`infra.checkpoints.shards`: every
        rank calls it; it returns once they are staged in host memory, the files are written in the background).
        Returns the plain state: rank 0 all of it, the others their RNG."""
        from infra.checkpoints.shards import write_shards

        if self._writing is not None:
            raise RuntimeError(f"trainer rank {self.rank}: a checkpoint is still being written; "
                               "wait for checkpoint_written(wait=True) before the next")
        tensors, rest = self.trainer.shard_state()
        if self.critic is not None:  # its shards and state beside the policy's, in the same files
            tensors[CRITIC], rest[CRITIC] = self.critic.shard_state()
        replicated = not self.trainer.sharded and self.world_size > 1  # whole copies: each rank writes a share
        self._writing = write_shards(tensors, directory, self._checkpoint_group,
                                     (self.rank, self.world_size) if replicated else None)
        return to_cpu(rest) if self.rank == 0 else {"rng": rest["rng"]}

    def checkpoint_written(self, wait: bool) -> dict[str, dict] | None:
        """The files this rank wrote for the checkpoint in flight, `{name: {"size", "sha256"}}`, once they are on
        disk; None while they are still being written (`wait=False`); `{}` with none in flight. Raises the write's
        error."""
        if self._writing is None:
            return {}
        if not wait and not self._writing.done():
            return None
        pending, self._writing = self._writing, None
        return pending.result()

    def load_checkpoint(self, directory: str, rest: dict[str, Any], rng: dict[str, Any] | None) -> None:
        """Restore this rank from a checkpoint directory: its layout of the shards (any rank count and sharding wrote
        them), the plain state `rest`, and `rng` (this rank's saved RNG; None: a rank the checkpoint had not)."""
        from infra.checkpoints.shards import read_shards

        rest = {k: v for k, v in rest.items() if k != "rng"} if rng is None else {**rest, "rng": rng}
        def read(tensors: dict) -> None:
            read_shards(tensors, directory, self._checkpoint_group)

        self.trainer.load_shard_state(read, rest)
        if self.critic is not None:
            self.critic.load_shard_state(read, rest)

    def read_text(self, path: str) -> str | None:
        """The text of `path` on this node, None when there is none (whether this node sees a driver's file)."""
        try:
            return Path(path).read_text()
        except OSError:
            return None

    def save_pretrained(self, path: str) -> str | None:
        """Rank 0 saves the policy (float32) and its tokenizer as a transformers directory (safetensors).

        Sharded, every rank calls this: the full weights are gathered into rank 0's host memory first, tensor by
        tensor. With LoRA the directory holds the merged model, and `adapter/` the adapter in PEFT's format
        (`rl_core.model.lora`); with PPO `critic/` holds the critic (`infra.workers.critic`)."""
        from infra.checkpoints.shards import release_staging
        from rl_core.model.loading import save_policy

        release_staging()  # the checkpoints' host copies go before the export's (the host-memory plan's moments)
        state = self.trainer.exported_model_state() if self.trainer.sharded else None
        if self.rank == 0:
            save_policy(self.trainer.model, self.tokenizer, path, state=state, base=self.cfg.model.name_or_path)
        if self.critic is not None:  # PPO: the critic beside it, as a model of its own
            self.critic.save_pretrained(str(Path(path) / CRITIC), self.rank)
        return path if self.rank == 0 else None

    def shutdown(self) -> None:
        """Leave the weight-sync group and the data-parallel process group."""
        if self.weight_group is not None:
            self.weight_group.close()
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

