"""The host-memory half of the preflight plan: what the trainer ranks of one node keep in host RAM.

A node runs `ranks_per_node` trainer ranks (`cluster.shard_size` under hsdp; else every rank when Ray is local, or
as many as an 8-GPU node holds at `cluster.gpus_per_worker`). Each rank's process holds its runtime (Python, torch,
transformers, the Ray worker) throughout, and host memory at three moments:

- start-up: the model is read in float32 into host memory before it reaches the device. Unsharded, every rank
  does this; sharded (`fsdp`/`hsdp`), each rank reads only its own rows of each tensor from the local safetensors
  files (memory-mapped), and only where it cannot (a hub id, a converted layout) rank 0 reads the whole model and
  broadcasts it tensor by tensor (`infra.workers.sharded_load.load_sharded_policy`); the plan counts that case, the larger.
- training with a checkpoint in flight: a save copies the rank's shards of the float32 weights (LoRA: the adapters)
  and of the AdamW state into host memory and writes them while the next steps run (`infra.checkpoints.shards`);
  unsharded, the replicas split the tensors between them. The copies are kept for the next save and released before
  the final export.
  Colocated vLLM under LoRA sleeps at level 1 and keeps its base weights in pinned host memory meanwhile.
- the final export: rank 0 gathers the whole float32 model into its host memory (sharded; unsharded it writes from
  the device one safetensors file, at most 5 GB, at a time).

The node's peak is the largest moment; with the host's RAM known (`cluster.host_memory_gib`, else this machine's
when its own GPU is the one planned), a peak above `USABLE_FRACTION` of it is a problem, with the knobs that fit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from rl_core.config.schema import PosttrainConfig
from rl_core.model.lora import adapter_counts
from rl_core.placement.run_shape import shard_mesh

GIB = 1024**3
PROCESS_BYTES = 2 * GIB  # a trainer rank's process: interpreter, torch, transformers, the Ray worker
GPUS_PER_NODE = 8  # the node a rank count is divided over when the cluster's nodes are not known
EXPORT_FILE_BYTES = 5 * 10**9  # transformers' save_pretrained: safetensors files of at most 5 GB
USABLE_FRACTION = 0.9
START, TRAIN, EXPORT = "start-up", "training, a checkpoint in flight", "final export"


@dataclass
class HostItem:
    name: str
    bytes: int  # the node's total: per-rank bytes x the ranks that hold it
    moments: tuple[str, ...]


@dataclass
class HostPlan:
    ranks_per_node: int
    why_ranks: str
    items: list[HostItem] = field(default_factory=list)
    host_bytes: int | None = None
    source: str = ""

    def add(self, name: str, nbytes: float, *moments: str) -> None:
        self.items.append(HostItem(name, int(nbytes), moments or (START, TRAIN, EXPORT)))

    def moment_bytes(self) -> dict[str, int]:
        return {m: sum(i.bytes for i in self.items if m in i.moments) for m in (START, TRAIN, EXPORT)}

    @property
    def peak(self) -> int:
        return max(self.moment_bytes().values())

    @property
    def peak_moment(self) -> str:
        totals = self.moment_bytes()
        return max(totals, key=totals.get)

    @property
    def usable(self) -> int | None:
        return None if self.host_bytes is None else int(self.host_bytes * USABLE_FRACTION)

    def fits(self) -> bool:
        return self.usable is None or self.peak <= self.usable


def ranks_per_node(cfg: PosttrainConfig, remote_ray: bool) -> tuple[int, str]:
    """How many trainer ranks share a node's host memory, and why that many."""
    c = cfg.cluster
    mesh = shard_mesh(cfg)
    if c.sharding == "hsdp" and mesh is not None:
        return mesh[1], f"cluster.shard_size={mesh[1]}: a shard group per node"
    if not remote_ray:
        return c.num_workers, "local Ray: every rank on this machine"
    if c.gpus_per_worker > 0:
        k = min(c.num_workers, max(1, int(GPUS_PER_NODE // c.gpus_per_worker)))
        return k, f"{GPUS_PER_NODE}-GPU nodes at cluster.gpus_per_worker={c.gpus_per_worker:g}"
    return c.num_workers, "CPU ranks: assumed on one node"


def host_plan(cfg: PosttrainConfig, n_params: int, n_tensors: int, linears, *, remote_ray: bool = False,
              host_bytes: int | None = None, source: str = "") -> HostPlan:
    """The host plan of one node for a policy of `n_params` parameters in `n_tensors` tensors (`linears`: its Linear
    layers, for LoRA's adapter count)."""
    k, why = ranks_per_node(cfg, remote_ray)
    plan = HostPlan(k, why, host_bytes=host_bytes, source=source)
    mesh = shard_mesh(cfg)
    div = mesh[1] if mesh else cfg.cluster.num_workers  # unsharded, the replicas split the tensors they write
    A, TA = adapter_counts(linears, cfg.model.lora)
    G, TG = (A, TA) if A else (n_params, n_tensors)
    each = f" x {k} ranks" if k > 1 else ""
    plan.add(f"rank processes: Python, torch, transformers, Ray worker{each}", k * PROCESS_BYTES)
    if mesh:
        plan.add("start-up, at most: rank 0 reads the float32 model and broadcasts it (hub id, converted layout; "
                 "else each rank reads its own rows)", 4 * n_params, START)
    else:
        plan.add(f"start-up: the float32 model read before it moves to the device{each}", k * 4 * n_params, START)
    staged = math.ceil((4 * G + 8 * G) / div) + 4 * TG
    shard = (f", 1/{div} shard" if mesh else f", 1/{div} of the replicated tensors") if div > 1 else ""
    plan.add(f"checkpoint staging copy: float32 {'adapters' if A else 'weights'} + AdamW state{shard}{each}",
             k * staged, TRAIN)
    if cfg.rl.objective.has_critic:  # PPO: the critic's shards go into the same checkpoint (its head: + hidden + 1)
        plan.add(f"checkpoint staging copy: the critic's, as the policy's{shard}{each}", k * staged, TRAIN)
        plan.add(f"start-up: the critic's whole float32 model, read by every rank before it moves to the device (and "
                 f"is sharded){each}", k * 4 * n_params, START)
    c = 2 if cfg.model.compute_dtype == "bfloat16" else 4
    if A and cfg.cluster.placement == "colocated" and cfg.rollout.backend == "vllm" and cfg.cluster.gpus_per_worker > 0:
        plan.add(f"vLLM asleep at level 1 (LoRA): base weights in pinned host memory{each}", k * n_params * c,
                 TRAIN, EXPORT)
    if mesh:
        plan.add("final export: rank 0 gathers the float32 model", 4 * n_params, EXPORT)
    else:
        plan.add("final export: one safetensors file at a time (at most 5 GB)", min(4 * n_params, EXPORT_FILE_BYTES),
                 EXPORT)
    return plan


def host_memory(cfg: PosttrainConfig, *, this_machine: bool, probe=None) -> tuple[int | None, str]:
    """`(bytes of one node's RAM, where that number comes from)`, or `(None, why unknown)`: `cluster.host_memory_gib`
    when set; else this machine's RAM when `this_machine` (the run's GPU is this machine's own)."""
    if cfg.cluster.host_memory_gib is not None:
        return int(cfg.cluster.host_memory_gib * GIB), f"cluster.host_memory_gib={cfg.cluster.host_memory_gib:g}"
    if not this_machine:
        return None, "set cluster.host_memory_gib to check it"
    nbytes = (probe or local_host_bytes)()
    return (nbytes, "this machine's RAM") if nbytes else (None, "this machine's RAM is unknown")


def local_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def render(plan: HostPlan) -> list[str]:
    def g(n: int) -> str:
        return f"{n / GIB:.2f}"

    where = (f"{g(plan.host_bytes)} GiB ({plan.source})" if plan.host_bytes else
             f"RAM unknown: {plan.source or 'not checked on a CPU run'}")
    lines = [f"  host memory of one node (x{plan.ranks_per_node} trainer rank(s), {plan.why_ranks}; {where})",
             f"    {'GiB':>8}  item"]
    short = {START: "S", TRAIN: "T", EXPORT: "E"}
    for it in plan.items:
        lines.append(f"    {g(it.bytes):>8}  {it.name}  [{''.join(short[m] for m in it.moments)}]")
    lines.append("    moments: " + ", ".join(f"{short[m]} {m} {g(b)}" for m, b in plan.moment_bytes().items()))
    verdict = "" if plan.usable is None else (f" of {g(plan.usable)} GiB usable ({USABLE_FRACTION:.0%}): "
                                              + ("fits" if plan.fits() else "DOES NOT FIT"))
    lines.append(f"    peak {g(plan.peak)} GiB ({plan.peak_moment}){verdict}")
    return lines


def problem(plan: HostPlan, cfg: PosttrainConfig, sharded_peak: int | None) -> str | None:
    """The host plan's problem (None when it fits or the RAM is unknown), with the knobs that fit."""
    if plan.fits():
        return None
    fixes = []
    if sharded_peak is not None and sharded_peak <= plan.usable:
        fixes.append(f"cluster.sharding=fsdp (peak {sharded_peak / GIB:.2f} GiB: rank 0 alone reads the model, each "
                     "rank stages only its shards)")
    if plan.ranks_per_node > 1:
        fixes.append("fewer trainer ranks per node (cluster.num_workers, or hsdp with a smaller cluster.shard_size)")
    fixes.append("a node with more RAM (cluster.host_memory_gib says what it has)")
    return (f"host memory: the peak of one node, {plan.peak / GIB:.2f} GiB in the {plan.peak_moment} moment, exceeds "
            f"the {plan.usable / GIB:.2f} GiB usable ({USABLE_FRACTION:.0%} of {plan.source}); " + "; or ".join(fixes))
