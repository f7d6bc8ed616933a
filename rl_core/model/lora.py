"""LoRA through PEFT (docs/lora.md): the wrapped policy, what it trains, saves and syncs, and its rules.

With `model.lora.r > 0` the policy is `peft.get_peft_model(policy, LoraConfig(...))`: the base weights
are frozen and only the adapters (`lora_A`, `lora_B` of every targeted Linear) require grad, so the
trainer's optimizer holds only them. This module is the one place that knows about PEFT:

- `wrap`: the PEFT model, with the base model's identity (`base_identity`: its `name_or_path` and a
  sha256 over its config and weights) kept on it for checkpoints;
- `trained_state` / `load_trained_state`: the trained tensors of a model (all of them without LoRA,
  the adapters with it), what a checkpoint holds; `check_base`: a checkpoint's base model is this one;
- `ReferenceView`: the frozen initial policy as the base model with the adapter disabled (no second copy);
- `adapter_state` (PEFT's saved names, what vLLM loads) and `merged_state` (base names, `W + (alpha/r) B A`);
- `save_adapter`: the adapter in PEFT's format (`rl_core.model.loading.save_policy` names its base model);
- `adapter_counts`: adapter parameters and tensors from a model's Linear shapes (the memory plan);
- `lora_problems`: the configurations LoRA refuses.

PEFT is imported inside the functions: importing this module costs nothing when LoRA is off.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

import torch

ADAPTER = "default"  # PEFT's adapter name
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
BASE_KEY = "base_model"  # the trainer state's entry for the base model's identity
_IDENTITY_ATTR = "_posttrain_base_identity"


def enabled(model_cfg) -> bool:
    return model_cfg.lora.r > 0


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT model (LoRA on)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def peft_config(lora_cfg, base_name_or_path: str | None = None, value_head: str | None = None,
                sequence: bool = False):
    """PEFT's `LoraConfig` of `model.lora`. `value_head`: the model is a critic (token classification) or, `sequence`,
    a reward model (sequence classification) whose head of that name trains whole (PEFT's modules_to_save), not
    through an adapter."""
    from peft import LoraConfig, TaskType

    target = lora_cfg.target_modules if lora_cfg.target_modules == "all-linear" else list(lora_cfg.target_modules)
    task = {"task_type": TaskType.CAUSAL_LM} if value_head is None else \
        {"task_type": TaskType.SEQ_CLS if sequence else TaskType.TOKEN_CLS, "exclude_modules": [value_head]}
    return LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=target,
                      base_model_name_or_path=base_name_or_path, **task)


def adapter_config_dict(lora_cfg, base_name_or_path: str | None, model: torch.nn.Module | None = None) -> dict:
    """`adapter_config.json` of the adapter: PEFT's own, with `target_modules` resolved when `model` is given."""
    if model is not None and is_lora(model):
        config = model.peft_config[ADAPTER]
    else:
        config = peft_config(lora_cfg, base_name_or_path)
    out = config.to_dict()
    out["base_model_name_or_path"] = base_name_or_path
    return json.loads(json.dumps(out, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def wrap(model: torch.nn.Module, lora_cfg, value_head: str | None = None) -> torch.nn.Module:
    """The PEFT model over `model` (frozen base, trainable adapters); `lora_A` draws from torch's RNG, `lora_B` is 0.
    `value_head`: PPO's critic or a reward model, whose head of that name trains whole beside the adapters."""
    from peft import get_peft_model

    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", ""))
    sequence = type(model).__name__.endswith("ForSequenceClassification")
    peft_model = get_peft_model(model, peft_config(lora_cfg, name or None, value_head, sequence))
    setattr(peft_model, _IDENTITY_ATTR, {"name_or_path": name})
    return peft_model


def base_identity(model: torch.nn.Module) -> dict[str, str]:
    """`{"name_or_path", "sha256"}` of a PEFT model's base: sha256 over its config (without its path) and every
    base tensor (name, dtype, shape, bytes, in name order). Computed once, then kept on the model."""
    known = getattr(model, _IDENTITY_ATTR, None) or {}
    if "sha256" in known:
        return dict(known)
    config = model.get_base_model().config.to_dict()
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(_base_state(model).items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    known = {"name_or_path": str(known.get("name_or_path", "")), "sha256": digest.hexdigest()}
    setattr(model, _IDENTITY_ATTR, known)
    return dict(known)


def _base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own tensors under their base names (the adapters, and the trained copy of a module PEFT
    trains whole such as a critic's value head, left out)."""
    out = {}
    for name, value in model.get_base_model().state_dict().items():
        if ".lora_" not in name and ".modules_to_save." not in name:
            out[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    return out


# ------------------------------------------------------------------------------------ checkpoints


def trained_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: its whole `state_dict()`, or with LoRA only the adapters."""
    state = model.state_dict()
    if not is_lora(model):
        return state
    return {name: state[name] for name in trained_names(model)}


def identity_entry(model: torch.nn.Module) -> dict:
    """`{BASE_KEY: base_identity}` for the trainer state of a LoRA model; `{}` otherwise."""
    return {BASE_KEY: base_identity(model)} if is_lora(model) else {}


def check_base(model: torch.nn.Module, state: Mapping) -> None:
    """Refuse a checkpoint whose adapters were trained on another base model (or that is not a LoRA checkpoint)."""
    saved = state.get(BASE_KEY)
    if not is_lora(model):
        if saved is not None:
            raise ValueError(f"the checkpoint holds LoRA adapters of {saved.get('name_or_path')!r} but this run trains "
                             "the full model (model.lora.r=0); resume with the model.lora settings it was saved with")
        return
    if saved is None:
        raise ValueError("the checkpoint holds a fully fine-tuned model, but this run trains LoRA adapters "
                         "(model.lora.r > 0); resume with model.lora.r=0, or start a new run")
    here = base_identity(model)
    if saved.get("sha256") != here["sha256"]:
        raise ValueError(f"the checkpoint's adapters were trained on base model {saved.get('name_or_path')!r} "
                         f"(sha256 {saved.get('sha256')}), but this run's base model is {here['name_or_path']!r} "
                         f"(sha256 {here['sha256']}); resume on the same base model weights, or start a new run")


def load_trained_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Inverse of `trained_state` (strict: with LoRA, exactly the adapters)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    names = set(trained_names(model))
    missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
    if missing or unexpected:
        raise KeyError(f"LoRA checkpoint does not match the adapters of this model (missing={missing[:5]}, "
                       f"unexpected={unexpected[:5]}); resume with the model.lora settings it was saved with")
    model.load_state_dict(dict(state), strict=False)


# ------------------------------------------------------------------------------------ reference


class ReferenceView(torch.nn.Module):
    """The frozen initial policy as a view of a PEFT policy: its forward runs the base model with the adapter
    disabled, in eval mode. The policy is held outside the module tree, so freezing this view (the trainer
    freezes its auxiliary models) leaves the adapters trainable."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        if not is_lora(policy):
            raise TypeError("ReferenceView needs a PEFT (LoRA) policy")
        self.__dict__["policy"] = policy

    @property
    def config(self):
        return self.policy.config

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()

    def forward(self, *args, **kwargs):
        policy = self.policy
        was_training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter():
                return policy(*args, **kwargs)
        finally:
            policy.train(was_training)


# ------------------------------------------------------------------------------------ weight sync


def adapter_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters under the names PEFT saves them (`adapter_model.safetensors`, what vLLM loads), cast to `dtype`."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {k: (v.detach() if dtype is None else v.detach().to(dtype)) for k, v in state.items()}


def merged_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base model's `state_dict()` names with every adapted weight merged (`W + (alpha/r) B A`, PEFT's
    `get_delta_weight`), cast to `dtype`; the model itself is not changed."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER)
    out = {}
    with torch.no_grad():
        for name, value in _base_state(model).items():
            v = value.detach()
            if name in deltas:
                v = v + deltas[name].to(v.dtype)
            out[name] = v if dtype is None else v.to(dtype)
    return out


def save_adapter(model: torch.nn.Module, path: str) -> None:
    """The adapter in PEFT's format: `adapter_model.safetensors` + `adapter_config.json` (and PEFT's model card,
    `README.md`; `rl_core.model.loading.name_base_model` names its base model)."""
    model.save_pretrained(path, safe_serialization=True)


def save_merged(model: torch.nn.Module, path: str) -> None:
    """A transformers directory (safetensors) of the merged model: `merge_and_unload` on a copy of the policy."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(path, safe_serialization=True)


# ------------------------------------------------------------------------------------ plan and rules


def targeted(name: str, target_modules) -> bool:
    """Whether the Linear module `name` gets an adapter (PEFT's rule: 'all-linear' is every Linear but the LM
    head; a list matches a module name or its last dotted components)."""
    if target_modules == "all-linear":
        return True
    return any(name == t or name.endswith("." + t) for t in target_modules)


def adapter_counts(linears: Iterable[tuple[str, int, int]], lora_cfg) -> tuple[int, int]:
    """`(parameters, tensors)` of the adapters over `linears` `(name, d_in, d_out)` (the LM head excluded):
    `r * (d_in + d_out)` and two tensors (A: r x d_in, B: d_out x r) per targeted Linear."""
    if lora_cfg.r <= 0:
        return 0, 0
    hit = [(d_in, d_out) for name, d_in, d_out in linears if targeted(name, lora_cfg.target_modules)]
    return sum(lora_cfg.r * (d_in + d_out) for d_in, d_out in hit), 2 * len(hit)


def vllm_rank(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds rank `r`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"model.lora.r={r} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def lora_problems(cfg) -> list[str]:
    """Configurations LoRA refuses, each naming the keys and what to do."""
    lora, cl = cfg.model.lora, cfg.cluster
    if lora.r <= 0:
        return []
    out = []
    if cl.sharding != "none" and cl.num_workers > 1:
        out.append(f"model.lora.r={lora.r} with cluster.sharding=fsdp: LoRA trains unsharded (the frozen base is "
                   "replicated, the adapters and their optimizer state are small); set cluster.sharding=none, or "
                   "model.lora.r=0 for sharded full fine-tuning")
    if cfg.rollout.backend == "vllm" and lora.r > VLLM_LORA_RANKS[-1]:
        out.append(f"model.lora.r={lora.r} with rollout.backend=vllm: vLLM serves adapters up to rank "
                   f"{VLLM_LORA_RANKS[-1]}; lower model.lora.r, or use rollout.backend=hf")
    return out
