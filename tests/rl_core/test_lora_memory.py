"""The memory plan with LoRA (rl_core/placement/memory.py, rl_core/model/lora.py): adapter parameters counted by hand against
a real PEFT-wrapped model, and the Qwen2.5-3B plan's items with LoRA r=16 against the same formula."""

from __future__ import annotations

import pytest

from rl_core.config import LoRAConfig, load_config
from rl_core.model import lora
from rl_core.placement.formulas import ASSUMED_PROMPT_TOKENS, GIB
from rl_core.placement.memory import memory_plan
from rl_core.placement.model_shape import model_shape, shape_from_config
from tests.rl_core.test_lora import tiny_llama
from tests.rl_core.test_memory_plan import GRPO, ON_4X80, QWEN_3B


@pytest.mark.parametrize("target", ["all-linear", ["q_proj", "v_proj"], ["down_proj"]])
def test_adapter_count_by_hand_equals_peft(target):
    h, inter, heads, kv, hd, layers, r = 32, 48, 4, 2, 8, 2, 4
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    chosen = list(dims) if target == "all-linear" else target
    by_hand = layers * sum(r * (dims[m][0] + dims[m][1]) for m in chosen)
    cfg = LoRAConfig(r=r, target_modules=target)
    model = lora.wrap(tiny_llama(0), cfg)
    trainable, _ = model.get_nb_trainable_parameters()

    shape = shape_from_config(tiny_llama(0).config)
    assert lora.adapter_counts(shape.linears, cfg) == (by_hand, 2 * layers * len(chosen))
    assert trainable == by_hand


def test_3b_plan_with_lora_r16_counts_gradients_and_adamw_of_the_adapters_only(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(**QWEN_3B).save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    P, T = shape.n_params, shape.n_param_tensors
    h, kv, inter, L, r = 2048, 2 * 128, 11008, 36, 16  # kv: 2 heads x head_dim 128
    A = L * r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))  # q, k, v, o, gate, up, down
    base = [f"model.name_or_path={tmp_path}", *ON_4X80, "model.compute_dtype=bfloat16", "cluster.sharding=none",
            "model.gradient_checkpointing=true", "rl.objective.kl_beta=0.04"]

    def trainer(*extra):
        plan = memory_plan(load_config(GRPO, [*base, *extra]), shape, prompt_tokens=ASSUMED_PROMPT_TOKENS,
                           gpu_bytes=80 * GIB)
        return plan.role("trainer")

    full, lo = trainer(), trainer("model.lora.r=16")
    assert A == 29_933_568
    assert lo.item("parameters").bytes == 4 * (P + A) and full.item("parameters").bytes == 4 * P
    assert lo.item("gradients").bytes == 4 * A and full.item("gradients").bytes == 4 * P
    assert lo.item("AdamW state").bytes == 8 * A + 4 * (2 * 7 * L) and full.item("AdamW state").bytes == 8 * P + 4 * T
    assert lo.item("AdamW step temporary").bytes == 4 * A
    assert lo.item("gradient all-reduce bucket").bytes == 4 * A  # under the 256 MiB bucket
    assert lo.item("weight sync").bytes == 2 * A  # colocated vLLM takes the bf16 adapters: one bucket holds them
    assert full.item("weight sync").bytes == 256 * 1024**2  # the full bf16 state streams in 256 MiB buckets
    # the KL reference is the base with the adapter disabled: no frozen copy, unless rl.reference names one
    assert not any(i.name.startswith("reference model") for i in lo.items)
    assert full.item("reference model").bytes == 2 * P
    assert trainer("model.lora.r=16", f"rl.reference={tmp_path}").item("reference model").bytes == 2 * P
    # the head is not adapted: under LoRA the fused head keeps no float32 weight-gradient accumulator
    V = QWEN_3B["vocab_size"]
    assert full.item("LM head").bytes - lo.item("LM head").bytes == 4 * V * h
    assert lo.peak < full.peak
