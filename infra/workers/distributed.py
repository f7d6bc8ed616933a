"""torch.distributed plumbing that spans Ray nodes: tcp:// rendezvous, and the weight-sync group.

- Rendezvous: rank 0 opens a `TCPStore` on its own node IP and a free port (the OS picks it) and
  reports `(ip, port)`; the other ranks connect to it. Nothing goes through a shared file, so the
  ranks may sit on different machines.
- Gloo binds to the interface that carries the node IP (127.0.0.1 -> `lo`), unless the user set
  `GLOO_SOCKET_IFNAME`, whatever the trainers' backend: NCCL groups and an in-process vLLM create gloo
  groups too, and gloo left to itself binds to whatever the host name resolves to (127.0.1.1 on many
  Debian-family hosts), which the other nodes cannot reach. NCCL's own interface is
  `NCCL_SOCKET_IFNAME`, the user's to set on multi-homed nodes (README, "What must be shared").
- `outside_default_group`: an in-process vLLM engine (colocated) builds its own one-process world instead of
  adopting the trainer ranks' default group.
- `WeightGroup`: a process group of its own (not torch's default group, which the trainer ranks
  already use and which an in-process vLLM may create) between trainer rank 0 (rank 0 of the group)
  and the rollout engines: gloo on CPU, NCCL on GPU.
- `WeightStream`: rank 0 sends the weights in buckets of one dtype (one collective per bucket, not
  per tensor), cast to the engines' dtype on the way, packing each bucket as the (gathered) tensors
  arrive and the next while one is in flight; engines load each bucket as it arrives. Every side computes a checksum of the bytes it
  sent or received, which the driver compares.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 1024 * 1024  # per broadcast; bounds the extra memory a sync needs on each side
DEFAULT_TIMEOUT = timedelta(minutes=10)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def node_ip() -> str:
    """This process's node IP as Ray sees it (127.0.0.1 on a loopback cluster)."""
    import ray

    return ray.util.get_node_ip_address()


def interface_for(ip: str) -> str | None:
    """The network interface that carries `ip` (e.g. `lo` for 127.0.0.1), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return "lo" if ip.startswith("127.") else None


def bind_gloo_to(ip: str) -> None:
    """Make gloo use the interface of `ip` (the user's GLOO_SOCKET_IFNAME wins)."""
    import os

    if "GLOO_SOCKET_IFNAME" not in os.environ and (iface := interface_for(ip)):
        os.environ["GLOO_SOCKET_IFNAME"] = iface


def open_store(ip: str, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[dist.TCPStore, int]:
    """Rank 0: a TCPStore listening on a free port of `ip` only (this node's IP; 127.0.0.1 for a local run);
    `(store, port)`.

    The store has no authentication, and torch's server binds every interface when it opens its own socket, so it
    is given one already bound to `ip` (`master_listen_fd`)."""
    listener = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((ip, 0))
        listener.listen(max(128, world_size))
        port = listener.getsockname()[1]
        store = dist.TCPStore(ip, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now
    return store, int(store.port)


def connect_store(host: str, port: int, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)


def init_default_group(backend: str, store: dist.TCPStore, rank: int, world_size: int, ip: str) -> None:
    """torch's default process group (the trainer ranks' data-parallel group) over a TCP store."""
    bind_gloo_to(ip)  # every backend: the gloo groups NCCL setups and vLLM create bind there too
    dist.init_process_group(backend, store=dist.PrefixStore("dp", store), rank=rank, world_size=world_size,
                            timeout=DEFAULT_TIMEOUT)


@contextmanager
def outside_default_group() -> Iterator[None]:
    """Run code that sets up torch.distributed for itself (an in-process vLLM engine) as if no default process group
    existed; the trainer ranks' group is the default again afterwards.

    vLLM's `init_distributed_environment` adopts an existing default group as its world and builds its
    tensor/pipeline-parallel groups over it (collectives over every trainer rank, in vLLM's own order). Hidden, it
    creates a world of its own (the engine's one process, on a port of its own) and keeps its groups in it: the
    engine never calls a collective on the trainers' group, nor they on its. Those groups stay registered with torch
    (vLLM passes them explicitly), only the default is put back.
    """
    from torch.distributed import distributed_c10d as c10d

    trainers = c10d._world.default_pg
    if trainers is None:  # one rank: no trainers' group to keep vLLM off; its own stays the default
        yield
        return
    c10d._update_default_pg(None)  # torch's own setter (the default group and the global rank it logs)
    try:
        yield
    finally:
        c10d._update_default_pg(trainers)


def shard_policy(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                 mesh_shape: tuple[int, int] | None = None) -> torch.nn.Module:
    """Shard `model` over the default process group with torch FSDP2: each decoder layer, then the root.

    `mesh_shape` (`rl_core.placement.run_shape.shard_mesh`): `(replicas, shard group size)`. `(1, world)` (or None)
    shards over every rank (FSDP); `(R, S)` is HSDP: ranks `[kS, (k+1)S)` shard the state among themselves, and
    the R groups hold replicas of it, so a gradient is reduce-scattered within a group and all-reduced across
    the groups (one all-reduce of a shard per group instead of collectives over every rank).

    The decoder layers are the modules whose class the model names in `_no_split_modules` (every
    transformers causal LM does, e.g. `Qwen2DecoderLayer`). The shards stay in their dtype (float32
    master weights and optimizer state). With a bf16 `compute_dtype`, FSDP gathers each layer's
    weights in bf16 for the forward/backward and reduce-scatters gradients in float32
    (`MixedPrecisionPolicy`), so no rank ever holds a whole bf16 copy of the model (autocast over
    gathered float32 weights would cache one). Returns the model, now an `FSDPModule` whose
    parameters are `DTensor` shards.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("cluster.sharding=fsdp/hsdp needs the trainer ranks' process group (cluster.num_workers > 1)")
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cluster.sharding=fsdp/hsdp: cannot find the decoder layers of {type(model).__name__} (it names "
                         "none in _no_split_modules); use cluster.sharding=none for this model")
    replicas, size = mesh_shape or (1, dist.get_world_size())
    if replicas * size != dist.get_world_size():
        raise ValueError(f"a mesh of {replicas} x {size} ranks for a group of {dist.get_world_size()}")
    mesh = (init_device_mesh(device.type, (size,)) if replicas == 1 else
            init_device_mesh(device.type, (replicas, size), mesh_dim_names=("replicate", "shard")))
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class WeightGroup:
    """A standalone process group between trainer rank 0 (group rank 0) and the rollout engines."""

    def __init__(self, store: dist.TCPStore, rank: int, world_size: int, backend: str, ip: str):
        prefixed = dist.PrefixStore("weights", store)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = DEFAULT_TIMEOUT
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            raise ValueError(f"weight-sync backend {backend!r} is not gloo or nccl")

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Broadcast `tensor` from group rank 0, in flight: the returned work's `wait()` ends it (NCCL: a side
        stream; gloo: a background thread), so the next bucket is packed while this one travels."""
        return self.pg.broadcast(tensor, 0)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:  # already torn down
                pass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the dtype on the wire (the engine's)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def wire_layout(state: dict[str, torch.Tensor], dtype: str | None = None) -> list[TensorSpec]:
    """What rank 0 sends, in order: every tensor's name, shape and wire dtype (`dtype` or its own)."""
    return [TensorSpec(k, tuple(v.shape), dtype or str(v.dtype).removeprefix("torch.")) for k, v in state.items()]


def buckets(layout: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `layout` grouped into runs of one dtype of at most `bucket_bytes` (a larger tensor alone)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(layout):
        nbytes = spec.numel * _DTYPES[spec.dtype].itemsize
        if not out or spec.dtype != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, spec.dtype
        out[-1].append(i)
        size += nbytes
    return out


def checksum(flat: torch.Tensor) -> int:
    """A checksum of a flat buffer's bytes: exact integer sums of its words, the same on every device.

    Two sums (all words, and the words at even positions) so that a stale, truncated or shuffled
    copy differs; order-independent within each sum, so any reduction order gives the same value.
    """
    raw = flat.contiguous().view(torch.uint8)
    if raw.numel() % 4 == 0:
        words = raw.view(torch.int32)
    elif raw.numel() % 2 == 0:
        words = raw.view(torch.int16)
    else:
        words = raw
    total = int(words.sum(dtype=torch.int64))
    even = int(words[::2].sum(dtype=torch.int64))
    return (total * 1_000_003 + even) % (2**61 - 1)


def combine(checksums: list[int]) -> str:
    """One hex string for the per-bucket checksums, in order."""
    acc = 0
    for c in checksums:
        acc = (acc * 0x100000001B3 + c) % (2**61 - 1)
    return f"{acc:016x}"


class WeightStream:
    """One weight sync's tensors, one bucket at a time: `(name, tensor)` pairs in `layout` order and wire dtypes.

    The sender (trainer rank 0) and a colocated engine pack the pairs `source` yields into one flat bucket at a
    time; with a `group` the bucket is then broadcast (rank 0) or received into (an engine, `source=None`). Each
    bucket's tensors are yielded as views of it, so a consumer that loads as it iterates (vLLM's `reload_weights`,
    a copy into the engine's parameters) holds at most two buckets, never a second full copy of the model: with a
    group the next bucket is packed, or its receive posted, while one travels (double-buffered: the sender does not
    wait on each bucket before packing the next); without one, the next bucket is packed after the consumer took
    this one's tensors. `source` too is read one tensor at a time (a sharded trainer gathers each as it is asked).
    Iterate once, to the end: every broadcast is a collective (`drain` finishes a stream a consumer left early).
    Then `checksum` (of the bytes, as `checksum`/`combine` define it) and `bytes` describe what went through.
    """

    def __init__(self, layout: list[TensorSpec], device: torch.device, group: WeightGroup | None = None,
                 source: Iterable[tuple[str, torch.Tensor]] | None = None, bucket_bytes: int = BUCKET_BYTES):
        if source is None and group is None:
            raise ValueError("a WeightStream packs a source, receives from a group, or both")
        self.layout, self.device, self.group, self.source = layout, device, group, source
        self.bytes = 0
        self._sums: list[int] = []
        self._done = False
        self._pairs = self._run(bucket_bytes)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._pairs

    def _run(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """With a group, pack (or post the receive of) bucket k+1 while bucket k's broadcast is in flight, then wait
        for bucket k and yield its views: two buckets at a time (double-buffered). Without one, one bucket."""
        source = None if self.source is None else iter(self.source)
        in_flight = None
        for idx in buckets(self.layout, bucket_bytes):
            dtype = _DTYPES[self.layout[idx[0]].dtype]
            flat = torch.empty(sum(self.layout[i].numel for i in idx), dtype=dtype, device=self.device)
            offset = 0
            for i in idx:
                spec = self.layout[i]
                if source is not None:
                    name, value = next(source, (None, None))
                    if name != spec.name:
                        raise ValueError(f"weight sync: the trainer's tensor {name!r} arrived where the layout has "
                                         f"{spec.name!r}; the sender and the layout disagree on the model's tensors")
                    flat[offset: offset + spec.numel].copy_(value.detach().reshape(-1))  # cast to the wire dtype
                offset += spec.numel
            if self.group is None:  # packed for a consumer in this process: nothing travels, one bucket at a time
                yield from self._arrived(idx, flat, None)
                continue
            work = self.group.broadcast(flat)
            if in_flight is not None:
                yield from self._arrived(*in_flight)
            in_flight = (idx, flat, work)
        if in_flight is not None:
            yield from self._arrived(*in_flight)
        self._done = True

    def _arrived(self, idx: list[int], flat: torch.Tensor, work: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """One bucket, its broadcast ended: checksummed, then its tensors as views of it."""
        if work is not None:
            work.wait()
        self._sums.append(checksum(flat))
        self.bytes += flat.numel() * flat.element_size()
        offset = 0
        for i in idx:
            spec = self.layout[i]
            yield spec.name, flat[offset: offset + spec.numel].view(spec.shape)
            offset += spec.numel

    def drain(self) -> WeightStream:
        """Go through whatever the consumer did not take (the collectives must all run)."""
        for _ in self._pairs:
            pass
        return self

    @property
    def checksum(self) -> str:
        if not self._done:
            raise RuntimeError("WeightStream.checksum before the stream was read to its end")
        return combine(self._sums)


def receive_into(stream: WeightStream, targets: dict[str, torch.Tensor]) -> None:
    """Copy each received tensor into the engine's own parameter of that name (an HF engine): no second copy."""
    with torch.no_grad():
        for name, value in stream:
            targets[name].copy_(value)
