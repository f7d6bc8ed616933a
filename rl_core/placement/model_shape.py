"""The model's dimensions the memory plan needs (`ModelShape`), read from its config without its weights:
`config.json` from a local directory or the Hugging Face cache, the model built on the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_core.model.protocol import ModelCapabilities


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the plan needs. The counts come from the model built on the meta device.

    `n_params` / `n_param_tensors`: `model.parameters()` (tied embeddings counted once).
    `matmul_params`: parameters of `nn.Linear` modules (what autocast casts to bf16; a tied
    lm_head counts its weight). `layer_params`: one decoder layer (the FSDP unit).
    `state_elements`: `state_dict()` (a tied weight under each of its names: what a full-state
    gather materialises). `largest_tensor`: elements of the largest parameter. None: estimated.
    """

    n_params: int
    n_param_tensors: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    matmul_params: int | None = None
    layer_params: int | None = None
    state_elements: int | None = None
    largest_tensor: int | None = None
    architecture: str = ""
    linears: tuple[tuple[str, int, int], ...] = ()  # (name, d_in, d_out) of every Linear but the LM head (LoRA)
    capabilities: ModelCapabilities | None = None  # the model protocol's (rl_core.model.protocol)

    @property
    def matmul(self) -> int:
        return self.n_params if self.matmul_params is None else self.matmul_params

    @property
    def layer(self) -> int:
        if self.layer_params is not None:
            return self.layer_params
        return max(self.n_params - self.vocab_size * self.hidden_size, 0) // max(self.num_layers, 1)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, an untied lm_head."""
        return max(self.n_params - self.num_layers * self.layer, 0)

    @property
    def state(self) -> int:
        return self.n_params if self.state_elements is None else self.state_elements

    @property
    def largest(self) -> int:
        return self.vocab_size * self.hidden_size if self.largest_tensor is None else self.largest_tensor


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def shape_from_config(config, trust_remote_code: bool = False) -> ModelShape:
    """`ModelShape` of a transformers config: the model is built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_core.model.protocol import capabilities

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    params = list(model.parameters())  # deduplicated: a tied lm_head is the embedding
    seen: set[int] = set()
    matmul = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    matmul += p.numel()
    head = model.get_output_embeddings()
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head)
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    text = _text_config(config)
    heads = int(text.num_attention_heads)
    return ModelShape(
        n_params=sum(p.numel() for p in params),
        n_param_tensors=len(params),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
        vocab_size=int(text.vocab_size),
        matmul_params=matmul,
        layer_params=sum(p.numel() for p in layers[0].parameters()) if layers else None,
        state_elements=sum(t.numel() for t in model.state_dict().values()),
        largest_tensor=max(p.numel() for p in params),
        architecture=type(model).__name__,
        linears=linears,
        capabilities=capabilities(model),
    )


def probe_model_shape(name_or_path: str, trust_remote_code: bool = False) -> tuple[ModelShape | None, str]:
    """`(shape, "")`, or `(None, why not)`: config.json from a local directory or the HF cache only, never a download."""
    from rl_core.model.loading import looks_local

    if looks_local(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            return None, f"{name_or_path!r} has no config.json (not built or not downloaded yet)"
        source = str(path)
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, "config.json")
        except Exception:  # noqa: BLE001 - an invalid repo id reads as "not cached"
            cached = None
        if not (isinstance(cached, str) and Path(cached).is_file()):
            return None, (f"{name_or_path!r} is neither a local directory nor in the Hugging Face cache "
                          "(the plan never downloads)")
        source = name_or_path
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
        return shape_from_config(config, trust_remote_code), ""
    except Exception as exc:  # noqa: BLE001 - an unknown architecture, remote code not allowed, a broken file
        return None, f"cannot build {name_or_path!r} from its config ({type(exc).__name__}: {exc})"


def model_shape(name_or_path: str, trust_remote_code: bool = False) -> ModelShape | None:
    """`ModelShape` of a local directory or a cached hub model; None when its config is not on this machine."""
    return probe_model_shape(name_or_path, trust_remote_code)[0]
