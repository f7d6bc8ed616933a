"""A tensor-parallel vLLM engine's workers as ranks of the weight-sync group.

A separate vLLM engine over K GPUs (`cluster.gpus_per_engine = K > 1`, vLLM's `tensor_parallel_size`) runs its model
in K worker processes, each holding 1/K of every layer. Each of them joins trainer rank 0's weight-sync group as a
rank of its own (engine e's workers hold K consecutive ranks), receives every broadcast bucket onto its own device
(NCCL on GPUs, gloo on CPU) and hands it to vLLM's reload as it arrives, which takes that worker's slices of each
tensor. Nothing passes through the engine's actor or host memory, and the broadcast that reaches one engine's
workers is the one that reaches every engine. An engine serving LoRA adapters takes them through its actor (one
rank), as an engine of one worker does.

`join`, `receive` and `leave` run inside the workers (`VLLMEngine.run_in_workers` / `update_weights_in_workers`:
vLLM pickles them to its worker processes); the group lives on the worker object.
"""

from __future__ import annotations

from typing import Any

import torch

from infra.workers.distributed import WeightGroup, WeightStream, connect_store

GROUP_ATTR = "posttrain_weight_group"  # the worker object's attribute holding its rank of the group


def weight_ranks(tensor_parallel: int, lora: bool) -> int:
    """The ranks one separate engine holds in the weight-sync group: each worker of a tensor-parallel vLLM engine;
    one (its actor) for an engine of one worker, or one that takes LoRA adapters."""
    return tensor_parallel if tensor_parallel > 1 and not lora else 1


def join(worker: Any, host: str, port: int, world_size: int, first_rank: int, backend: str, ip: str) -> int:
    """In a vLLM worker: join the group as rank `first_rank` + this worker's tensor-parallel rank; returns the rank."""
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = first_rank + get_tensor_model_parallel_rank()
    store = connect_store(host, port, world_size)
    setattr(worker, GROUP_ATTR, WeightGroup(store, rank, world_size, backend, ip))
    return rank


def receive(worker: Any, layout: list) -> dict[str, Any]:
    """In a vLLM worker: take rank 0's broadcast, bucket by bucket onto this worker's device, vLLM's reload loading
    each tensor's slices as it arrives (two buckets at a time at most). Returns the checksum and bytes received."""
    group = getattr(worker, GROUP_ATTR, None)
    if group is None:
        raise RuntimeError("this vLLM worker is in no weight-sync group: join must come before receive")
    stream = WeightStream(layout, torch.device(worker.device), group=group)
    worker.reload_weights(weights_iterator=iter(stream))
    stream.drain()
    return {"checksum": stream.checksum, "bytes": stream.bytes}


def leave(worker: Any) -> None:
    """In a vLLM worker: leave the group."""
    group = getattr(worker, GROUP_ATTR, None)
    if group is not None:
        group.close()
        setattr(worker, GROUP_ATTR, None)


def agreed_checksum(received: list[dict[str, Any]]) -> str:
    """One checksum for an engine whose workers each received the broadcast: theirs when they agree, else a value that
    names each worker's and matches no sender (the run's check then stops the step)."""
    sums = [r["checksum"] for r in received]
    if len(set(sums)) == 1:
        return sums[0]
    return "workers disagree: " + ", ".join(f"worker {i}: {c}" for i, c in enumerate(sums))
