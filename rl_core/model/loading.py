"""Policy loading and the project's own tiny causal LM.

`load_policy` serves hub ids and local directories alike (the tiny model is saved with
`save_pretrained`, so the same code path loads it). `build_tiny_model` makes a ~1.07M-parameter
Llama (hidden 128, 4 layers, MLP 512, 4 heads) with a character-level tokenizer, deterministically
from a seed. Llama and not Qwen2: for `model_type=qwen2` `AutoTokenizer` substitutes Qwen's own
tokenizer class, which drops the spaces of a character-level vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from rl_core.atomic import atomic_directory

TINY_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
# "\n" plus printable ASCII (space .. "~"): digits, operators and GSM8K text all round-trip.
TINY_CHARS = ("\n",) + tuple(chr(c) for c in range(32, 127))
# Unicode punctuation common in GSM8K, folded to ASCII before tokenisation (anything else is <unk>).
_ASCII_FOLDS = {
    "\u2019": "'",
    "\u2018": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u2013": "-",
    "\u2014": "-",
    "\u2212": "-",
}
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
TINY_ARCH = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def looks_local(name_or_path: str) -> bool:
    """Local path or hub id: a path that exists here is local (`ckpt/warm` too, as transformers' `from_pretrained`
    reads it); otherwise a hub id is `name` or `org/name`, and anything else (./x, /x, ~/x, a/b/c) is a local path
    that is missing."""
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        return True
    return Path(name_or_path).exists()


def resolve_model_path(name_or_path: str, key: str = "model.name_or_path") -> str:
    """A local directory as an absolute path (it must exist), or a hub id unchanged.

    (`looks_local` tells which.)
    """
    if not looks_local(name_or_path):
        return name_or_path
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{key}={name_or_path!r} does not exist; build the tiny model with "
            "`posttrain init-model --out artifacts/tiny-model/init` and `posttrain warm-start`, "
            f"or point {key} at a hub id or a saved model directory"
        )
    return str(path.resolve())


def load_tokenizer(model_cfg):
    """The policy's tokenizer alone (no weights): left padding, a pad token (its EOS) when it has none."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model_cfg.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model_cfg.trust_remote_code))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def enable_tf32(device: torch.device) -> None:
    """On CUDA, float32 matmuls in TF32 (Ampere and later): the float32 paths (master weights, a float32
    recipe's forward) at tensor-core speed. The log-softmax, ratios and reductions stay float32."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


@contextlib.contextmanager
def matmul_precision_kept() -> Iterator[None]:
    """Put this process's float32 matmul precision back after the block: vLLM's GPU worker sets it to "highest" as
    it starts, which in a trainer rank with a colocated engine would turn TF32 off for the trainer."""
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def torch_dtype(name: str) -> torch.dtype:
    """`"float32"` / `"bfloat16"` / `"float16"` as a torch dtype (a clear error for anything else)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_policy(model_cfg, *, device: str | torch.device | None = None, dtype: str = "float32"):
    """Load `(model, tokenizer)` from `model_cfg.name_or_path` (hub id or local directory).

    `model_cfg` is a `ModelConfig` (fields `name_or_path`, `trust_remote_code`). The tokenizer is
    set to left padding, and given a pad token (its EOS) when it has none. The model is returned in
    eval mode, on `device` when given, with parameters in `dtype`: float32 for a policy that is
    trained (master weights), `model.compute_dtype` for frozen copies (reference, teacher, an
    engine's own copy).
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_cfg.name_or_path)
    tokenizer = load_tokenizer(model_cfg)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), trust_remote_code=bool(model_cfg.trust_remote_code)
    )
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def save_policy(model, tokenizer, path: str | Path, *, state: dict[str, torch.Tensor] | None = None,
                merged: bool = True, adapter_dir: str | None = "adapter", base: str | None = None) -> Path:
    """The policy and its tokenizer as a transformers directory (safetensors) at `path`: what `final_model/` and
    `posttrain export` write. `state`: the whole model's tensors when `model` holds only shards of them.

    With LoRA (`rl_core.model.lora`), `merged` writes the merged model at `path` (loadable as any model) and `adapter_dir`
    the adapter in PEFT's format (`adapter_model.safetensors`, `adapter_config.json`) under `path/adapter_dir`
    (`""`: at `path` itself, loadable with `peft.PeftModel.from_pretrained(base, path)`; None: not written), its
    base model named by `base`, the run's `model.name_or_path` (`name_base_model`: the hub id when it is one).
    Without LoRA the model is written whole and these are ignored."""
    from rl_core.model import lora

    path = Path(path)
    if not lora.is_lora(model):
        model.save_pretrained(path, state_dict=state, safe_serialization=True)
    else:
        if not merged and adapter_dir is None:
            raise ValueError("save_policy: a LoRA policy needs merged=True or an adapter_dir")
        if merged:
            lora.save_merged(model, str(path))
        if adapter_dir is not None:
            lora.save_adapter(model, str(path / adapter_dir))
            if base is not None:
                name_base_model(path / adapter_dir, base)
    tokenizer.save_pretrained(path)
    return path


def base_model_name(name_or_path: str) -> tuple[str, bool]:
    """`(name, is_hub_id)` of a run's base model (`model.name_or_path`) as an adapter names it: a hub id as it is
    (it loads anywhere); a local directory by its absolute path (it loads only where that path holds the model)."""
    if not looks_local(name_or_path):
        return name_or_path, True
    return str(Path(name_or_path).expanduser().resolve()), False


LOCAL_BASE_NOTE = """
## Base model

This adapter was trained on a local base model with no hub id, so `adapter_config.json` names it by its path on the
machine that wrote it: `{path}`. On another machine, load your copy of that model and the adapter on it:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("<your copy of the base model>"),
                                  "<this directory>")
```

or set `base_model_name_or_path` in `adapter_config.json` to where your copy is.
"""

HUB_BASE_NOTE = """
## Base model

`{name}`, the hub id the run trained from (`adapter_config.json`'s `base_model_name_or_path`):
`peft.AutoPeftModelForCausalLM.from_pretrained("<this directory>")` loads it with this adapter.
"""


def name_base_model(path, name_or_path: str) -> str:
    """Name the base model of the adapter at `path`, in `adapter_config.json` (`base_model_name_or_path`) and in the
    model card `README.md`: the run's hub id (`base_model_name`), else the local path, with a note in the card on
    loading the adapter with a copy of the base elsewhere (and no `base_model` in the card's metadata, which is for
    hub ids). PEFT itself writes the path the model was loaded from, which for a hub model in a local directory or
    cache is this machine's. Returns the name written."""
    import json

    from huggingface_hub import ModelCard, ModelCardData

    name, hub = base_model_name(name_or_path)
    path = Path(path)
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = name
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    readme = path / "README.md"
    card = ModelCard.load(readme) if readme.is_file() else ModelCard(f"---\n{ModelCardData().to_yaml()}\n---\n")
    card.data.base_model = name if hub else None
    tags = [t for t in card.data.tags or [] if not t.startswith("base_model:")]  # PEFT's tag names the loaded path
    card.data.tags = tags + ([f"base_model:adapter:{name}"] if hub else [])
    card.text = card.text.rstrip("\n") + "\n" + (HUB_BASE_NOTE.format(name=name) if hub else
                                                  LOCAL_BASE_NOTE.format(path=name))
    card.save(readme)
    return name


def build_tiny_tokenizer():
    """The character-level tokenizer: ids 0-3 are `<pad> <bos> <eos> <unk>`, then "\\n" and printable ASCII.

    Encoding prepends `<bos>`; decoding concatenates characters (spaces survive).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARS)}
    # BPE without merges = one token per character, unknown characters -> <unk>.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC()] + [normalizers.Replace(src, dst) for src, dst in _ASCII_FOLDS.items()]
    )
    tok.decoder = decoders.Fuse()
    bos_id = vocab["<bos>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=TINY_ARCH["max_position_embeddings"],
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny Llama + char tokenizer from `seed` and save both to `out_dir` (safetensors).

    Same seed -> bitwise-identical weights (a private `torch.Generator` initialises every
    parameter; the global RNG is neither read nor changed).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_ARCH,
        hidden_act="silu",
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # the default init draws from the global RNG; keep it untouched
        model = LlamaForCausalLM(config)
    return _save_built(model, tokenizer, seed, config.initializer_range, out_dir)


# The mixture-of-experts variant (Mixtral: top-k softmax routers, `rl_core.model.routing`): the tiny model's
# attention, and in each layer `experts` expert MLPs of half the dense width, `top_k` of them per token.
TINY_MOE_ARCH = {**TINY_ARCH, "intermediate_size": 256}


def build_tiny_moe_model(out_dir: str | Path, seed: int = 0, experts: int = 4, top_k: int = 2) -> Path:
    """Build the tiny Mixtral (the tiny model's attention, `experts` experts per layer, `top_k` per token) + the char
    tokenizer from `seed` and save both to `out_dir`; deterministic like `build_tiny_model`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if not 1 <= top_k <= experts < 255:
        raise ValueError(f"a tiny MoE needs 1 <= top_k <= experts < 255, got experts={experts}, top_k={top_k}")
    tokenizer = build_tiny_tokenizer()
    config = MixtralConfig(vocab_size=len(tokenizer), **TINY_MOE_ARCH, num_local_experts=experts,
                           num_experts_per_tok=top_k, router_jitter_noise=0.0, output_router_logits=False,
                           hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        model = MixtralForCausalLM(config)
    return _save_built(model, tokenizer, seed, config.initializer_range, out_dir)


def _save_built(model, tokenizer, seed: int, std: float, out_dir: str | Path) -> Path:
    """Seed-initialise `model` (`_seeded_init_`), give it the tokenizer's special ids, save both to `out_dir`."""
    from transformers import GenerationConfig

    _seeded_init_(model, seed, std=std)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    out = Path(out_dir)
    with atomic_directory(out) as tmp:  # a reader never sees half a model; a crash leaves only a .tmp-* sibling
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


# What a saved model directory must hold (save_pretrained of the model and of a fast tokenizer).
MODEL_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def model_problem(path: str | Path, *, built_here: bool = True) -> str | None:
    """Why the model directory `path` is not whole, judged by content (None: it is): its JSON files parse, and each
    safetensors file's header and size agree (a truncated file fails here, not at load time).

    `built_here`: a directory `build_tiny_model`/`warm_start` wrote, which must hold `MODEL_JSON_FILES` and
    safetensors weights; any other (a downloaded model) must hold config.json, and is checked for what it has."""
    import json

    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a directory"
    for name in MODEL_JSON_FILES if built_here else ("config.json",):
        try:
            json.loads((path / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return f"{path / name} is missing"
        except (OSError, ValueError) as exc:
            return f"{path / name} is not valid JSON ({exc})"
    weights = sorted(path.glob("*.safetensors"))
    if built_here and not weights:
        return f"{path} holds no *.safetensors weights"
    for file in weights:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for every kind of damage
            return f"{file} is damaged ({exc})"
    return None


def _seeded_init_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Re-initialise every parameter from `seed`: normal(0, std) for matrices, ones for norm weights."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1:  # RMSNorm weights (the Llama here has no biases)
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
