"""Rollout engines: one interface (`RolloutEngine`), an HF engine (CPU/GPU) and a vLLM engine (GPU or vLLM's CPU build).

`make_engine(rollout_cfg, model, tokenizer)` picks the engine from `rollout.backend`. The vLLM
engine is imported only when selected, so CPU machines never import vLLM.
"""

from __future__ import annotations

from rl_core.rollout.base import (
    Completions,
    RolloutEngine,
    SamplingParams,
    build_completions,
    concat_completions,
)
from rl_core.rollout.hf import HFEngine
from rl_core.rollout.seeds import completion_seeds


def sampling_params_from_config(
    rollout_cfg, *, seed: int | None = None, greedy: bool = False
) -> SamplingParams:
    """`SamplingParams` from a `RolloutConfig` (temperature, top_p, max_tokens) and a seed."""
    return SamplingParams(
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        max_tokens=rollout_cfg.max_tokens,
        seed=seed,
        greedy=greedy,
    )


def make_engine(
    rollout_cfg, model, tokenizer, *, seed: int = 0, model_path: str | None = None, dtype: str = "auto",
    max_model_len: int | None = None, sleep_mode: bool = False, trust_remote_code: bool = False,
    lora_config: dict | None = None, tensor_parallel_size: int = 1, record_routes: bool = False,
) -> RolloutEngine:
    """Build the engine named by `rollout_cfg.backend` ('hf' or 'vllm').

    hf: samples from `model` in place, under autocast when `dtype` ("float32"/"bfloat16") is not
    the model's own parameter dtype. vllm: loads its own copy of the weights from `model_path`
    (the `model.name_or_path` the policy was loaded from; required) and takes later weights through
    `update_weights`; `model` is not used by it (pass None). `max_model_len`: the longest prompt
    plus `rollout.max_tokens`; `sleep_mode`: release GPU memory between rollouts (colocated);
    `lora_config` (vllm, `model.lora.r > 0`): the adapters' `adapter_config.json`, and `update_weights`
    then takes the adapters' tensors; `tensor_parallel_size` (vllm): the GPUs (on CPU, worker processes)
    one engine splits the model over. `record_routes` (a mixture-of-experts model, `model.routing_replay=rollout`):
    the engine returns the experts of every token (`Completions.routes`).
    """
    backend = rollout_cfg.backend
    if backend == "hf":
        return HFEngine(model, tokenizer, seed=seed, compute_dtype=None if dtype == "auto" else dtype,
                        record_routes=record_routes)
    if backend == "vllm":
        from rl_core.rollout.vllm import VLLMEngine

        if model_path is None:
            raise ValueError(
                "rollout.backend=vllm needs model_path (the policy's model.name_or_path) to load the engine"
            )
        return VLLMEngine(
            model_path,
            tokenizer,
            dtype=dtype,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            sleep_mode=sleep_mode,
            trust_remote_code=trust_remote_code,
            lora_config=lora_config,
            record_routes=record_routes,
            **({"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}),
        )
    raise ValueError(f"rollout.backend={backend!r} is not one of 'hf', 'vllm'")


__all__ = [
    "Completions",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "build_completions",
    "completion_seeds",
    "concat_completions",
    "make_engine",
    "sampling_params_from_config",
]
