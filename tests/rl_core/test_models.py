"""Tiny model: deterministic by seed, save/load round trip, char tokenizer that keeps spaces."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_core.config.schema import ModelConfig
from rl_core.models import build_tiny_model, count_parameters, load_policy


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "init", seed=0)


def test_same_seed_gives_identical_weights_and_other_seed_differs(tmp_path, tiny_dir):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    a, b, c = (load_file(d / "model.safetensors") for d in (tiny_dir, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    matrices = [k for k in a if a[k].ndim == 2]
    assert matrices and all(not torch.equal(a[k], c[k]) for k in matrices)


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    build_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(state, torch.get_rng_state())


def test_architecture_size_and_special_ids(tiny_dir):
    model, tok = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
    assert cfg.max_position_embeddings >= 2048
    assert 0.9e6 <= count_parameters(model) <= 1.2e6
    assert [tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token] == [
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
    ]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    for c in (cfg, model.generation_config):
        assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    assert len(tok) == cfg.vocab_size == 4 + 1 + 95  # specials, "\n", printable ASCII


def test_save_load_round_trip_serves_same_weights_and_logits(tiny_dir):
    on_disk = load_file(tiny_dir / "model.safetensors")
    m1, tok = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    m2, _ = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    sd = m1.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in on_disk.items())
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    assert torch.equal(m1(ids).logits, m2(ids).logits)
    assert not m1.training


def test_load_policy_is_float32_master_weights_unless_a_frozen_copy_asks(tiny_dir):
    cfg = ModelConfig(name_or_path=str(tiny_dir), compute_dtype="bfloat16")
    model, _ = load_policy(cfg)  # the trained policy: float32 whatever the compute dtype
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    frozen, _ = load_policy(cfg, dtype=cfg.compute_dtype)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="float16"):
        load_policy(cfg, dtype="float8")


def test_retired_model_dtype_key_names_its_replacement():
    from rl_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.compute_dtype"):
        load_config("recipes/arithmetic.py", ["model.dtype=bfloat16"])


def test_load_policy_missing_local_dir_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="init-model"):
        load_policy(ModelConfig(name_or_path=str(tmp_path / "nope" / "model")))


@pytest.mark.parametrize(
    "text",
    [
        "12+34=46",
        "  two  spaces,  leading and trailing  ",
        "Natalia sold clips to 48 of her friends in April.\nHow many? 48/2 = <<48/2=24>>24\n#### 72",
        "a-b*c/d (e) [f] {g} $1,000.50 100% #~`|\\^_'\"",
    ],
)
def test_tokenizer_round_trips_text_one_token_per_char(tiny_dir, text):
    _, tok = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_unknown_chars_and_left_padding(tiny_dir):
    _, tok = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    assert tok.decode(tok("It\u2019s")["input_ids"], skip_special_tokens=True) == "It's"  # folded quote
    assert tok("\u00e9")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]
    batch = tok(["1+2=", "10+20="], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id, tok.pad_token_id]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


def test_chat_template_renders_generation_prompt(tiny_dir):
    _, tok = load_policy(ModelConfig(name_or_path=str(tiny_dir)))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<bos>") and "What is 2+3?" in text and text.endswith("Assistant: ")
