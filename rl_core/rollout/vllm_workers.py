"""What runs in vLLM's workers, or feeds them, for `rl_core.rollout.vllm.VLLMEngine`: the chunks of whole decoder layers
a tensor-parallel engine hands its worker processes when it is given the weights (`update_weights`), and the sums of
the parameters a worker holds. Kept apart so a worker process that unpickles one of these functions imports little.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

RELOAD_CHUNK_BYTES = 256 * 2**20  # a tensor-parallel engine's host copy during a sync: one chunk of this size
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")  # `model.layers.7.` : a decoder layer's tensors share it


def layer_chunks(pairs: Iterable[tuple[str, torch.Tensor]],
                 limit: int = RELOAD_CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream `pairs` as lists of `(name, host copy)` that hold whole decoder layers: a list is closed at the
    first layer boundary at or past `limit` bytes (so it holds less than `limit` plus one layer); tensors outside
    the layers (embeddings, final norm, head) are groups of one. The tensors are copied, since a stream's tensors
    may be views of a receive buffer that the next bucket refills."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size, group = 0, None
    for name, tensor in pairs:
        match = _LAYER.match(name)
        key = match.group(1) if match else name
        if chunk and key != group and size >= limit:
            yield chunk
            chunk, size = [], 0
        group = key
        host = tensor.detach().to("cpu", copy=True)
        chunk.append((name, host))
        size += host.numel() * host.element_size()
    if chunk:
        yield chunk


def reload_chunk(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Inside each vLLM worker: reload the layers of one chunk. vLLM's in-place reload warns once for every layer
    the call leaves out (they keep their weights, as meant here), so its loaders' warnings are held back."""
    import logging

    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        worker.reload_weights(weights_iterator=weights)
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def parameter_sums(model) -> dict[str, tuple[float, float]]:
    """Inside vLLM's worker: `(sum, sum of |x|)` in float64 of every readable parameter, by the HF names it holds."""
    from rl_core.rollout.verify import fused_name, tensor_sum

    packed = getattr(model, "packed_modules_mapping", None) or {}
    out = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:  # a linear weight vLLM's CPU build repacked into oneDNN's layout
            continue
        out[fused_name(name, packed)] = tensor_sum(param)  # no float64 copy beside vLLM's weights and KV cache
    return out
