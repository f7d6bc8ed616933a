"""The run's shape: how many rows, ranks, engines and teacher replicas a config makes, and how the trainer ranks
and rollout engines split their GPUs. Preflight, the memory plan and the actors that place the run read it here."""

from __future__ import annotations

from rl_core.config.schema import PosttrainConfig


def rows_per_prompt(cfg: PosttrainConfig) -> int:
    """Training rows per prompt: `rollout.n` completions, or DPO's two rows (chosen, rejected) per pair."""
    return cfg.rl.objective.rows_per_prompt(cfg.rollout.n)


def per_replica_batch(cfg: PosttrainConfig) -> int:
    """Completions (DPO: pair rows) each data-parallel worker trains on per step (0 when it does not divide)."""
    total = cfg.rollout.prompts_per_step * rows_per_prompt(cfg)
    return total // cfg.cluster.num_workers if total % cfg.cluster.num_workers == 0 else 0


def num_engines(cfg: PosttrainConfig) -> int:
    """Rollout engines of a run: one per trainer rank when colocated, `rollout.num_engines` (default 1) when separate;
    none when the trainer ranks train a reward model (nothing is sampled)."""
    if not cfg.rl.objective.trains_policy:
        return 0
    if cfg.cluster.placement == "colocated":
        return cfg.cluster.num_workers
    return cfg.rollout.num_engines or 1


def shard_mesh(cfg: PosttrainConfig) -> tuple[int, int] | None:
    """The trainer ranks' device mesh as `(replicas, shard group size)`, or None when the state is not sharded:
    `fsdp` over several ranks is `(1, num_workers)`, `hsdp` `(num_workers // shard_size, shard_size)`."""
    c = cfg.cluster
    if c.sharding == "fsdp" and c.num_workers > 1:
        return 1, c.num_workers
    if c.sharding == "hsdp" and c.shard_size and c.num_workers % c.shard_size == 0:
        return c.num_workers // c.shard_size, c.shard_size
    return None


def tensor_parallel_size(cfg: PosttrainConfig) -> int:
    """GPUs a rollout engine splits the model over (vLLM's `tensor_parallel_size`): `cluster.gpus_per_engine` when it
    is above 1 (separate vLLM engines), else 1."""
    c = cfg.cluster
    if c.placement == "separate" and cfg.rollout.backend == "vllm" and c.gpus_per_engine > 1:
        return int(c.gpus_per_engine)
    return 1


# The share of a GPU that Ray counts for one teacher replica in its trainer rank's bundle (the rank asks for the
# rest). Ray's count only pins both to the same GPU; whether the teacher's memory fits is the memory plan's check.
TEACHER_GPU_SHARE = 0.01


def teacher_replicas(cfg: PosttrainConfig) -> int:
    """OPD teacher replicas: `cluster.teacher_replicas`, default one per trainer rank; 0 for a run without a teacher."""
    if cfg.rl.objective.topology != "teacher":
        return 0
    return cfg.cluster.teacher_replicas or cfg.cluster.num_workers


def teachers_per_rank(cfg: PosttrainConfig) -> int:
    """The most teacher replicas on one trainer rank's node and GPU (replica i on rank i % cluster.num_workers)."""
    return -(-teacher_replicas(cfg) // cfg.cluster.num_workers)


def reward_model_replicas(cfg: PosttrainConfig) -> int:
    """Reward-model replicas (`data.rewards` entries with a `model`, or a judge's local `model`): one per trainer rank,
    in its bundle; 0 when no entry names one or nothing is sampled."""
    if not cfg.rl.objective.trains_policy or not any(e.model is not None or (e.judge is not None and e.judge.model)
                                                     for e in cfg.data.rewards):
        return 0
    return cfg.cluster.num_workers


def trainer_gpus(cfg: PosttrainConfig) -> float:
    """GPUs a trainer rank's actor asks Ray for: its bundle's `cluster.gpus_per_worker` less the shares of the
    teachers and the reward model that sit beside it."""
    gpus = cfg.cluster.gpus_per_worker
    beside = teachers_per_rank(cfg) + (1 if reward_model_replicas(cfg) else 0)  # each asks for its share
    return round(gpus - beside * TEACHER_GPU_SHARE, 4) if gpus > 0 else 0.0


def num_mini_batches(cfg: PosttrainConfig) -> int:
    """n_mini: optimizer steps fed by one collected batch."""
    per = per_replica_batch(cfg)
    mini = cfg.rl.mini_batch_per_replica or per
    return max(per // mini, 1) if per else 1


def batch_row_multiple(cfg: PosttrainConfig) -> int:
    """What a step's rows are a multiple of, so the ranks, their mini-batches and micro-batches split it evenly:
    `cluster.num_workers x n_mini x rl.micro_batch_per_replica`. A batch whose rows vary (agent episodes that start
    new samples, `rl_core.annotate`) is filled to it; the usual batch already is one."""
    return cfg.cluster.num_workers * num_mini_batches(cfg) * (cfg.rl.micro_batch_per_replica or 1)


def mini_batch_rows(cfg: PosttrainConfig, rows: int) -> int | None:
    """Rows per optimizer step of a rank's shard of `rows`: n_mini steps whatever its rows (a batch filled to
    `batch_row_multiple` splits evenly), so `rl.mini_batch_per_replica` for the usual batch; None: one step."""
    return max(1, rows // num_mini_batches(cfg)) if cfg.rl.mini_batch_per_replica else None
