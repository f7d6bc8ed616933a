"""What the memory plan counts for a vLLM engine beside its reservation (rl_core/placement/formulas.py, roles.py), by
hand for two model shapes, a tiny Llama and a Llama-2-7B-like one: what a sleeping engine keeps on the GPU (its
persistent buffers and CUDA graphs, scaled with the model, never below a 1 GiB floor) and the one layer's weights a
reload stages anew during the weight sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_core.config import load_config
from rl_core.placement import formulas as mem
from rl_core.placement.formulas import ASSUMED_PROMPT_TOKENS, GIB, MIB
from rl_core.placement.memory import memory_plan
from rl_core.placement.model_shape import model_shape
from tests.rl_core.test_memory_plan import GRPO, ON_4X80

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True}
LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False}
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}
FSDP_BF16 = ("cluster.sharding=fsdp", "model.compute_dtype=bfloat16", "model.gradient_checkpointing=true")


def shape_dir(tmp_path_factory, dims: dict) -> Path:
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("shape")
    LlamaConfig(**dims, max_position_embeddings=4096).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return {"tiny": shape_dir(tmp_path_factory, TINY), "7b": shape_dir(tmp_path_factory, LLAMA_7B)}


def by_hand(dims: dict) -> dict[str, int]:
    """vLLM 0.32's defaults on an 80 GiB GPU, bf16 (c = 2): 16384 batched tokens, 51 captured batch sizes (the largest
    512), an estimated 256 KiB of graphs per captured size and decoder layer (+ 1 for embedding and head)."""
    h, L, inter, c = dims["hidden_size"], dims["num_hidden_layers"], dims["intermediate_size"], 2
    hd = h // dims["num_attention_heads"]
    q, kv = dims["num_attention_heads"] * hd, dims["num_key_value_heads"] * hd
    buffers = 16384 * (h * c + 16)  # inputs_embeds in bf16 + int ids, positions, slots per token
    graphs = 51 * (L + 1) * 256 * 1024
    pool = 512 * (2 * h + 2 * q + 2 * kv + 3 * inter) * c  # one layer's decode working set, 512 tokens
    layer = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h  # q, o, k, v, gate/up/down, two norms
    largest = dims["vocab_size"] * h  # the embedding (and an untied head)
    total = buffers + graphs + pool
    return {"asleep": max(GIB, total), "sum": total, "reload": max(layer, largest) * c, "layer": layer,
            "largest": largest}


def plan(path: Path, *overrides: str):
    cfg = load_config(GRPO, [f"model.name_or_path={path}", *ON_4X80, *FSDP_BF16, *overrides])
    return memory_plan(cfg, model_shape(str(path)), prompt_tokens=ASSUMED_PROMPT_TOKENS, gpu_bytes=80 * GIB)


@pytest.mark.parametrize("name, dims", [("tiny", TINY), ("7b", LLAMA_7B)])
def test_a_sleeping_engine_and_a_reload_are_planned_from_the_model_shape(dirs, name, dims):
    want = by_hand(dims)
    trainer = plan(dirs[name]).role("trainer")
    asleep, reload = trainer.item("vLLM asleep"), trainer.item("vLLM reload")
    assert asleep.bytes == want["asleep"] == GIB  # both below the floor: 41 MiB and 0.59 GiB of buffers and graphs
    assert asleep.phases == tuple(p for p in trainer.phases if p != mem.GENERATE)  # awake, inside the reservation
    assert reload.bytes == want["reload"] and reload.phases == (mem.SYNC,)
    # the tiny model's largest staged module is its embedding; the 7B's, a decoder layer (202M > 131M parameters)
    assert (want["layer"] > want["largest"]) == (name == "7b")
    assert trainer.phase_bytes()[mem.SYNC] == sum(it.bytes for it in trainer.items
                                                  if it.phases is None or mem.SYNC in it.phases)
    assert reload.bytes + asleep.bytes + trainer.item("vLLM weights").bytes <= trainer.phase_bytes()[mem.SYNC]
    assert mem.GENERATE not in reload.phases
    # a separate tensor-parallel engine stages its share of the layer while it loads the received weights
    engine = plan(dirs[name], "cluster.placement=separate", "rollout.num_engines=1",
                  "cluster.gpus_per_engine=2").role("engine")
    assert engine.item("vLLM reload").bytes == want["reload"] // 2 and engine.item("vLLM reload").phases == (mem.SYNC,)
    # LoRA loads the adapters as a LoRA request: nothing is reloaded
    lora = plan(dirs[name], "model.lora.r=8").role("trainer")
    assert not any(it.name.startswith("vLLM reload") for it in lora.items)


def test_what_sleep_keeps_scales_with_the_model_above_the_floor():
    from rl_core.placement.model_shape import ModelShape

    for dims, below in ((TINY, True), (LLAMA_7B, True), (LLAMA_70B, False)):
        hd = dims["hidden_size"] // dims["num_attention_heads"]
        shape = ModelShape(n_params=1, n_param_tensors=1, hidden_size=dims["hidden_size"],
                           num_layers=dims["num_hidden_layers"], num_heads=dims["num_attention_heads"],
                           num_kv_heads=dims["num_key_value_heads"], head_dim=hd,
                           intermediate_size=dims["intermediate_size"], vocab_size=dims["vocab_size"])
        want = by_hand(dims)
        assert sum(mem.vllm_asleep_parts(shape, 2).values()) == want["sum"]
        assert mem.vllm_asleep_bytes(shape, 2) == want["asleep"]
        assert (want["sum"] < GIB) == below
    # Llama-2-70B: 256 MiB of buffers, 81 layers x 51 sizes of graphs (1033 MiB) and a 118 MiB pool
    assert by_hand(LLAMA_70B)["sum"] == 16384 * (8192 * 2 + 16) + 51 * 81 * 256 * 1024 + 512 * 120832 * 2
    assert round(by_hand(LLAMA_70B)["sum"] / MIB) == 1407


def test_the_plan_report_names_and_explains_both_items(dirs):
    text = plan(dirs["7b"]).render()
    asleep = next(line for line in text.splitlines() if "vLLM asleep" in line)
    assert "persistent buffers" in asleep and "CUDA graphs" in asleep and "at least 1 GiB" in asleep
    assert "estimate" in asleep and "vllm_asleep_resident_gib" in asleep
    reload = next(line for line in text.splitlines() if "vLLM reload" in line)
    assert "W " in reload and "layer" in reload and "0.38" in reload  # 202M parameters in bf16
