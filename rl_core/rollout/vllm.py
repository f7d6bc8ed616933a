"""vLLM rollout engine (GPU, optional extra `gpu`): the `RolloutEngine` interface over `vllm.LLM`.

vLLM is imported inside the methods only: importing this module, or `rl_core.rollout`, never
imports vLLM, and CPU machines never construct this engine (`rollout.backend=hf` there).

Running it on a GPU box (see docs/rollout.md):

    pip install -e '.[gpu]'                       # vllm==0.33.0 with its CUDA torch build
    posttrain run recipes/grpo_gsm8k.py -- rollout.backend=vllm rollout.gpu_memory_utilization=0.4

Mapping from the config / `SamplingParams`:
- temperature, top_p, max_tokens, seed -> `vllm.SamplingParams` of the same names, `n` per prompt,
  `logprobs=0` (the sampled token's log-prob only); greedy -> temperature 0.
- The engine is created with `logprobs_mode="processed_logprobs"`, i.e. log-probs after
  temperature scaling, which is the trainer's `log_softmax(logits / T)` as long as `top_p == 1`
  (with `top_p < 1` vLLM's processed log-probs are of the truncated distribution, unlike the HF
  engine's; preflight warns about top_p < 1 under ratio-based surrogates).
- Weight updates: the trainer's state dict goes to `model.load_weights` in the vLLM worker (through
  `LLM.apply_model`), then the prefix cache is reset so no KV computed with old weights is reused
  (stale rollout weights, PITFALLS.md). The flow logs the sampling-vs-trainer log-prob gap every
  step, which catches a missed update.
- Prompts go in as token ids (`TokensPrompt`); outputs come back as token ids and are assembled
  by `build_completions`, cut after the first EOS exactly like the HF engine.
"""

from __future__ import annotations

import os
import time

import torch

from rl_core import faults
from rl_core.rollout.base import Completions, RolloutEngine, SamplingParams, build_completions, check_prompts


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        model_path: str,
        tokenizer,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.4,
        max_tokens: int = 1024,
        seed: int = 0,
        policy_version: int = 0,
        **llm_kwargs,
    ):
        # In-process engine core: weight updates run in this process instead of pickling the
        # whole state dict to an engine subprocess.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RuntimeError(
                "rollout.backend=vllm needs vLLM on a GPU machine: pip install -e '.[gpu]'; "
                "on CPU use rollout.backend=hf"
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
        self._version = int(policy_version)
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **llm_kwargs,
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        weights = [(name, tensor.detach()) for name, tensor in state_dict.items()]

        def _load(model):
            model.load_weights(weights=weights)

        self.llm.apply_model(_load)
        self.llm.reset_prefix_cache()
        self._version = int(version)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        faults.maybe_fail("rollout")
        check_prompts(prompt_ids, n)
        params = VLLMSamplingParams(
            n=n,
            temperature=0.0 if sampling.is_greedy else sampling.temperature,
            top_p=1.0 if sampling.is_greedy else sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )
        started = time.perf_counter()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False
        )
        self.last_generate_s = time.perf_counter() - started
        responses, logps = [], []
        for request in outputs:  # in prompt order
            for out in request.outputs:  # n completions
                ids = list(out.token_ids)  # includes the EOS token when it stopped on EOS
                responses.append(ids)
                logps.append([float(step[tok].logprob) for tok, step in zip(ids, out.logprobs or [])])
        return build_completions(
            prompt_ids,
            responses,
            logps,
            n=n,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            max_tokens=sampling.max_tokens,
            policy_version=self._version,
        )
