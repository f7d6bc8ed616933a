"""How one trainer rank builds its trainer: the policy (sharded, LoRA-wrapped or whole), the frozen reference when the
objective needs one, the objective from the registry, and the `LLMTrainer` around them (`PolicyWorker.setup`)."""

from __future__ import annotations

from typing import Any

import torch

from rl_core.algorithms.registry import build_objective
from rl_core.config import PosttrainConfig
from rl_core.model.loading import enable_tf32
from rl_core.model.protocol import enable_gradient_checkpointing


def build_trainer(cfg: PosttrainConfig, dp_reducer: Any = None, device: torch.device | None = None):
    """`(trainer, tokenizer)` of one rank: policy (+ frozen reference when the objective needs one), objective."""
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.model import lora
    from rl_core.model.loading import load_policy, torch_dtype
    from rl_core.placement.run_shape import shard_mesh
    from rl_core.training.trainer import LLMTrainer

    torch.manual_seed(cfg.job.seed)
    enable_tf32(device or torch.device("cpu"))
    if not cfg.rl.objective.trains_policy:  # a reward model (rl.objective.type=reward_model)
        model, tokenizer = _reward_model(cfg, device)
    elif mesh := shard_mesh(cfg):  # built sharded: every rank reads its own shards (float32 masters)
        from infra.workers.sharded_load import load_sharded_policy

        model, tokenizer = load_sharded_policy(cfg.model, device or torch.device("cpu"),
                                               torch_dtype(cfg.model.compute_dtype), mesh,
                                               cfg.model.gradient_checkpointing)
    else:
        model, tokenizer = load_policy(cfg.model, device=device)  # float32 master weights
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if lora.enabled(cfg.model):  # frozen base, trainable adapters (preflight refuses LoRA when sharded)
            model = lora.wrap(model, cfg.model.lora)
    objective = build_objective(cfg, ObjectiveContext.from_config(cfg))  # rl.objective.build (built-in or custom)
    auxiliary: dict[str, torch.nn.Module] = {}
    if objective.reference_scorer is not None:
        ref_cfg = cfg.model if cfg.rl.reference is None else cfg.model.model_copy(update={"name_or_path": cfg.rl.reference})
        if lora.is_lora(model) and cfg.rl.reference is None:  # the initial policy: the base, adapter disabled
            reference = lora.ReferenceView(model)
        else:
            reference, _ = load_policy(ref_cfg, device=device, dtype=cfg.model.compute_dtype)  # frozen: compute dtype
            reference.eval().requires_grad_(False)
        auxiliary["reference"] = reference
    trainer = LLMTrainer(model, objective, cfg.rl.optimizer, auxiliary_models=auxiliary, dp_reducer=dp_reducer,
                         compute_dtype=torch_dtype(cfg.model.compute_dtype), max_staleness=cfg.rl.async_steps,
                         max_rollout_logp_abs_diff=cfg.rollout.max_logp_abs_diff,
                         # a mini-batch of dynamic sampling's padding alone (or of truncated rows) has no loss token
                         skip_empty_updates=getattr(cfg.rl.objective, "mask_truncated", False)
                         or cfg.rollout.filter_groups,
                         routing_replay=cfg.model.routing_replay)
    return trainer, tokenizer


def _reward_model(cfg: PosttrainConfig, device: torch.device | None):
    """`(model, tokenizer)`: the reward model to train from `model.name_or_path` (whole, LoRA-wrapped or sharded as
    the policy would be), float32 master weights."""
    from rl_core.algorithms.reward_model import HEAD, reward_model
    from rl_core.model import lora
    from rl_core.model.loading import load_tokenizer, resolve_model_path, torch_dtype
    from rl_core.placement.run_shape import shard_mesh

    tokenizer = load_tokenizer(cfg.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = reward_model(resolve_model_path(cfg.model.name_or_path), trust_remote_code=cfg.model.trust_remote_code,
                         pad_token_id=pad)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if lora.enabled(cfg.model):
        model = lora.wrap(model, cfg.model.lora, value_head=HEAD)
    device = device or torch.device("cpu")
    if mesh := shard_mesh(cfg):
        from infra.workers.distributed import shard_policy

        model = shard_policy(model, device, torch_dtype(cfg.model.compute_dtype), mesh)
    return model.to(device), tokenizer
