"""Tiny model: deterministic by seed, save/load round trip, char tokenizer that keeps spaces."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_core.config.schema import ModelConfig
from rl_core.model.loading import build_tiny_model, count_parameters, load_policy


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


# ---------------------------------------------------------------- artifacts: whole or rebuilt


def _truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage", ["truncated weights", "missing tokenizer", "bad config"])
def test_a_damaged_tiny_model_is_detected_by_content_and_rebuilt(tmp_path, monkeypatch, damage):
    """With config.json present and model.safetensors truncated the model counted as complete and every later run
    failed in SafetensorError; now the content is checked and the quickstart build replaces it."""
    from infra.artifacts import TINY_INIT, ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.data.arithmetic import make_arithmetic_data
    from rl_core.model.loading import model_problem
    from tests.conftest import recipe

    monkeypatch.chdir(tmp_path)
    make_arithmetic_data("data/arithmetic", seed=0)
    build_tiny_model(TINY_INIT, seed=0)
    good = (TINY_INIT / "model.safetensors").read_bytes()
    if damage == "truncated weights":
        _truncate(TINY_INIT / "model.safetensors", len(good) - 1000)
    elif damage == "missing tokenizer":
        (TINY_INIT / "tokenizer.json").unlink()
    else:
        _truncate(TINY_INIT / "config.json", 10)
    assert model_problem(TINY_INIT) is not None
    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={TINY_INIT}"])
    messages: list[str] = []
    assert ensure_quickstart_artifacts(cfg, announce=messages.append) == ["tiny_model"]
    assert any("rebuilding" in m and str(TINY_INIT) in m for m in messages), messages
    assert model_problem(TINY_INIT) is None and (TINY_INIT / "model.safetensors").read_bytes() == good
    assert not [p for p in TINY_INIT.parent.iterdir() if p.name.startswith(".tmp-")]


def test_a_torn_quickstart_data_file_is_rebuilt(tmp_path, monkeypatch):
    from infra.artifacts import ARITHMETIC_DIR, ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.data.arithmetic import make_arithmetic_data
    from tests.conftest import recipe

    monkeypatch.chdir(tmp_path)
    make_arithmetic_data(ARITHMETIC_DIR, seed=0)
    good = (ARITHMETIC_DIR / "train.jsonl").read_text()
    _truncate(ARITHMETIC_DIR / "train.jsonl", len(good) // 2 + 7)  # cut mid-line
    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={tmp_path / 'mine'}"])
    messages: list[str] = []
    assert ensure_quickstart_artifacts(cfg, announce=messages.append) == ["arithmetic_data"]
    assert any("train.jsonl:" in m and "rebuilding" in m for m in messages), messages


def test_a_damaged_model_directory_given_by_the_user_is_refused_naming_the_file(tmp_path):
    from rl_core.config import load_config
    from rl_core.preflight.machine import machine_problems
    from tests.conftest import recipe

    model = build_tiny_model(tmp_path / "mine", seed=0)
    _truncate(model / "model.safetensors", 100)
    (problem,) = machine_problems(load_config(recipe("arithmetic"), [f"model.name_or_path={model}"]))
    assert str(model / "model.safetensors") in problem and "damaged" in problem and "posttrain init-model" in problem


def test_two_first_runs_build_each_artifact_once_and_never_see_half_of_it(tmp_path, monkeypatch):
    """Two first runs in one directory at once: the build lock makes the second wait and find the model whole."""
    import threading

    from infra.artifacts import TINY_INIT, ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.model.loading import model_problem
    from tests.conftest import recipe

    monkeypatch.chdir(tmp_path)
    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={TINY_INIT}"])
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_quickstart_artifacts(cfg, lambda _: None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [[], ["arithmetic_data", "tiny_model"]]
    assert model_problem(TINY_INIT) is None


def test_artifacts_and_data_files_are_written_atomically(tmp_path, monkeypatch):
    """A crash mid-write leaves the old file or directory whole (the new one is written beside it, then renamed)."""
    from rl_core.atomic import atomic_directory
    from rl_core.data.arithmetic import write_jsonl

    path = write_jsonl([{"a": 1}], tmp_path / "d" / "x.jsonl")
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "model") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed")
    assert not (tmp_path / "model").exists() and [p.name for p in tmp_path.iterdir()] == ["d"]
    model = build_tiny_model(tmp_path / "model", seed=0)
    def killed(fd):
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr("rl_core.atomic.os.fsync", killed)
    with pytest.raises(RuntimeError):
        write_jsonl([{"a": 2}], path)
    assert path.read_text() == '{"a": 1}\n' and [p.name for p in path.parent.iterdir()] == ["x.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "model"] and (model / "config.json").is_file()


def test_an_existing_local_directory_with_one_slash_is_local_and_made_absolute(tmp_path, monkeypatch, tiny_dir):
    """`ckpt/warm` has the shape of a hub id (`org/name`); it exists here, so it is a local directory."""
    import shutil

    from rl_core.model.loading import looks_local, resolve_model_path

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, tmp_path / "ckpt" / "warm")
    for local in ("ckpt/warm", "./ckpt/warm"):
        assert looks_local(local)
        assert resolve_model_path(local) == str((tmp_path / "ckpt" / "warm").resolve())
    model, _ = load_policy(ModelConfig(name_or_path="ckpt/warm"))
    assert count_parameters(model) == count_parameters(load_policy(ModelConfig(name_or_path=str(tiny_dir)))[0])
    # a missing `org/name` is a hub id, left as it is; a missing ./x or a/b/c is a (missing) local path
    assert not looks_local("Qwen/Qwen2.5-3B-Instruct") and resolve_model_path("Qwen/Qwen2.5-3B-Instruct") == \
        "Qwen/Qwen2.5-3B-Instruct"
    assert looks_local("./ckpt/cold") and looks_local("runs/x/final_model")
    with pytest.raises(FileNotFoundError, match="ckpt/cold"):
        resolve_model_path("./ckpt/cold")
