"""The policy built sharded at start-up (`load_sharded_policy`): each trainer rank fills its own FSDP shards from the
local checkpoint's safetensors files, reading only its rows of each tensor; rank 0 loads and broadcasts only where
the checkpoint cannot be read that way (a hub id, a converted layout, a quantized checkpoint). Which files may be
read, and what makes a checkpoint quantized: `infra.workers.checkpoint_index`."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from infra.workers.checkpoint_index import FLOAT_DTYPES, checkpoint_files, quantized
from infra.workers.distributed import shard_policy

log = logging.getLogger(__name__)


def read_own_shards(model: torch.nn.Module, files: dict[str, str]) -> bool:
    """Fill a sharded model's (materialised, uninitialised) tensors from the checkpoint: each rank reads only its own
    rows of every parameter (`safe_open(...).get_slice`, through the memory map), cast to the parameter's dtype, and
    the persistent buffers whole; the non-persistent ones (rotary frequencies) are computed as transformers'
    `from_pretrained` computes them (`_init_weights` of the module that holds them). False, having read nothing, when
    the checkpoint does not hold every parameter under the model's own name and shape (a renamed or converted
    layout), stores a float tensor of the model in another dtype (int8, float8: quantized, its rows alone are not
    the weights), or a module holds both parameters and computed buffers: the caller then loads on rank 0."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    persistent = set(model.state_dict().keys())
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    computed = [m for prefix, m in model.named_modules()
                if any(f"{prefix}.{n}".lstrip(".") not in persistent for n, _ in m.named_buffers(recurse=False))]
    if any(next(m.parameters(recurse=False), None) is not None for m in computed):
        return False
    handles: dict[str, Any] = {}
    for name, tensor in tensors:
        if name not in files:
            return False
        if files[name] not in handles:
            handles[files[name]] = safe_open(files[name], "pt", device="cpu")
        stored = handles[files[name]].get_slice(name)
        if tuple(stored.get_shape()) != tuple(tensor.shape):
            return False
        if tensor.is_floating_point() and stored.get_dtype() not in FLOAT_DTYPES:
            return False
    with torch.no_grad():
        for name, tensor in tensors:
            rows = handles[files[name]].get_slice(name)
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                                      tensor.placements)
            else:
                local, shape, offset = tensor, tuple(tensor.shape), (0,) * tensor.dim()
            if local.numel():
                local.copy_(rows[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(local.dtype))
        for module in computed:
            model._init_weights(module)
    return True


def load_sharded_policy(model_cfg, device: torch.device, compute_dtype: torch.dtype, mesh_shape: tuple[int, int],
                        gradient_checkpointing: bool = False):
    """`(model, tokenizer)`: the policy built sharded (`shard_policy`), float32 master weights.

    Every rank builds the model's skeleton on the meta device, shards it, and fills its shards itself from the local
    checkpoint (`read_own_shards`: its rows of each tensor, read through the memory map), so no rank loads the whole
    model and none waits on another while it loads. Where that cannot be done (a hub id, a checkpoint whose names or
    shapes are not the model's own, a quantized checkpoint: `quantized`), rank 0 alone loads the checkpoint into host
    memory, and each tensor is broadcast from it and kept by every rank as its shard (`set_model_state_dict` with
    `broadcast_from_rank0`), its computed buffers (rotary frequencies) broadcast too. `model.posttrain_load` says
    which: "own shards" or "rank 0". A malformed index, or one naming a file outside the model directory
    (`checkpoint_files`), is a `ValueError` on every rank, decided together: nothing is loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from rl_core.model.loading import load_policy, load_tokenizer, resolve_model_path
    from rl_core.model.protocol import enable_gradient_checkpointing

    path = resolve_model_path(model_cfg.name_or_path)
    trust = bool(model_cfg.trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    tokenizer = load_tokenizer(model_cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust, dtype=torch.float32)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    shard_policy(model, device, compute_dtype, mesh_shape)
    model.to_empty(device=device)
    try:
        files, refused = checkpoint_files(path), None
    except ValueError as error:  # a malformed or escaping index: refused before any file is opened
        files, refused = {}, error
    why_rank_0 = quantized(config, files)
    own = refused is None and why_rank_0 is None and read_own_shards(model, files)
    ok = torch.tensor([-1 if refused else int(own)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank the same way: the fallback and a refusal are collective
    if ok.item() < 0:
        raise refused or ValueError(f"another trainer rank refused the safetensors index of {path} (its error says "
                                    "why); every rank's copy of the model directory must be whole and the same")
    if why_rank_0 and dist.get_rank() == 0:
        log.warning("%s is quantized (%s): rank 0 loads it and broadcasts each tensor, since rows sliced without "
                    "its scales would be wrong weights", path, why_rank_0)
    if ok.item():
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: what from_pretrained derives from the model's config
            model.generation_config = GenerationConfig.from_model_config(config)
    else:
        full = load_policy(model_cfg)[0] if dist.get_rank() == 0 else None  # float32, on CPU
        set_model_state_dict(model, full.state_dict() if full is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        buffers = [None if full is None else {k: v.detach() for k, v in full.named_buffers()}]
        dist.broadcast_object_list(buffers, src=0, device=device if device.type == "cuda" else None)
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[0][name])
        if full is not None:
            model.generation_config = full.generation_config  # what rank 0's export writes
    model.posttrain_load = "own shards" if ok.item() else "rank 0"
    model.eval()
    return model, tokenizer
