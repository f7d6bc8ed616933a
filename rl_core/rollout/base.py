"""The rollout engine interface, its sampling parameters and the completions it returns.

Every engine (HF on CPU/GPU, vLLM on GPU) returns the same `Completions`, from which the flow
builds the training batch directly. Layout, with `N = len(prompt_ids) * n`, `P` the longest prompt
and `R` the longest response in the batch (≤ `max_tokens`):

    input_ids       [N, P+R] long     left-padded prompt, then the response; pad after EOS
    attention_mask  [N, P+R] long     1 on real prompt tokens and response tokens up to EOS
    response_mask   [N, P+R] float32  1 on response tokens up to AND including the first EOS
    sampling_logp   [N, P+R] float32  log_softmax(logits / T)[token] of each sampled token; 0 off the response mask
    prompt_index    [N]      long     which input prompt; the n completions of prompt i are rows i*n .. i*n+n-1

Masks come from the EOS position, never from pad ids: a model may sample the pad token as an
ordinary response token.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `greedy=True` (or `temperature == 0`) takes the argmax token.

    `seed`: the same seed, prompts and weights give the same samples (a private `torch.Generator`
    is seeded with it; global RNG state is never read). `None` uses the engine's own generator,
    which advances from call to call.

    `top_p < 1` samples from the nucleus, but `sampling_logp` stays the log-prob under the full
    temperature-scaled distribution — the quantity the trainer computes — so it is not the
    probability with which the token was actually drawn (preflight warns about this under
    ratio-based surrogates).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the returned log-probs: T, or 1 when greedy with temperature 0."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Completions:
    """Sampled completions, ready to become a training batch (layout in the module docstring).

    `finish_reason[j]` is 'stop' when row j sampled EOS (its last response token), else 'length'.
    `response_lengths [N]` counts response tokens including the EOS.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    sampling_logp: torch.Tensor
    prompt_index: torch.Tensor
    finish_reason: list[str]
    policy_version: int
    prompt_length: int
    eos_token_id: int
    pad_token_id: int
    n: int = 1
    response_lengths: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.response_lengths = self.response_mask.sum(-1).long()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        return len(self) // self.n

    def response_token_ids(self, include_eos: bool = False) -> list[list[int]]:
        """Response token ids of each row, up to the first EOS (included only if asked)."""
        out = []
        for row, length, reason in zip(self.input_ids, self.response_lengths.tolist(), self.finish_reason):
            ids = row[self.prompt_length : self.prompt_length + length].tolist()
            if reason == "stop" and not include_eos:
                ids = ids[:-1]
            out.append(ids)
        return out

    def decode_responses(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Response text of each row, up to (not including) the first EOS."""
        return tokenizer.batch_decode(self.response_token_ids(), skip_special_tokens=skip_special_tokens)

    def to(self, device) -> Completions:
        for name in (
            "input_ids",
            "attention_mask",
            "response_mask",
            "sampling_logp",
            "prompt_index",
            "response_lengths",
        ):
            setattr(self, name, getattr(self, name).to(device))
        return self


def build_completions(
    prompt_ids: list[list[int]],
    responses: list[list[int]],
    response_logps: list[list[float]],
    *,
    n: int,
    eos_token_id: int,
    pad_token_id: int,
    max_tokens: int,
    policy_version: int,
) -> Completions:
    """Assemble `Completions` from per-row response tokens (engines that return lists, e.g. vLLM).

    `responses[j]` / `response_logps[j]` belong to prompt `j // n`; a response is cut after its
    first EOS (tokens after it are dropped); finish reason is 'stop' iff an EOS was kept.
    """
    rows = len(prompt_ids) * n
    if len(responses) != rows or len(response_logps) != rows:
        raise ValueError(
            f"expected {rows} responses ({len(prompt_ids)} prompts x n={n}), got {len(responses)}"
        )
    cut, cut_lp, reasons = [], [], []
    for toks, lps in zip(responses, response_logps):
        toks, lps = list(toks)[:max_tokens], list(lps)[:max_tokens]
        if eos_token_id in toks:
            k = toks.index(eos_token_id) + 1
            toks, lps, reason = toks[:k], lps[:k], "stop"
        else:
            reason = "length"
        cut.append(toks)
        cut_lp.append(lps)
        reasons.append(reason)
    P = max(len(p) for p in prompt_ids)
    R = max(1, max(len(t) for t in cut))
    input_ids = torch.full((rows, P + R), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, P + R), dtype=torch.long)
    response_mask = torch.zeros((rows, P + R), dtype=torch.float32)
    logp = torch.zeros((rows, P + R), dtype=torch.float32)
    for j, (toks, lps) in enumerate(zip(cut, cut_lp)):
        prompt = prompt_ids[j // n]
        input_ids[j, P - len(prompt) : P] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[j, P - len(prompt) : P] = 1
        if toks:
            input_ids[j, P : P + len(toks)] = torch.tensor(toks, dtype=torch.long)
            attention_mask[j, P : P + len(toks)] = 1
            response_mask[j, P : P + len(toks)] = 1.0
            logp[j, P : P + len(toks)] = torch.tensor(lps, dtype=torch.float32)
    return Completions(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        sampling_logp=logp,
        prompt_index=torch.arange(len(prompt_ids)).repeat_interleave(n),
        finish_reason=reasons,
        policy_version=policy_version,
        prompt_length=P,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        n=n,
    )


class RolloutEngine(abc.ABC):
    """Samples completions from the current policy weights.

    `last_generate_s`: seconds the most recent `generate` call spent sampling (for perf metrics).
    `generate(prompt_ids, n, sampling)`: `prompt_ids` are unpadded token-id lists (as the
    tokenizer returns them, special tokens included); returns `n` completions per prompt.
    `update_weights(state_dict, version)`: load the trainer's weights; completions sampled
    afterwards carry `policy_version == version`.
    """

    last_generate_s: float = 0.0

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions: ...

    @abc.abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    @abc.abstractmethod
    def policy_version(self) -> int: ...


def check_prompts(prompt_ids: list[list[int]], n: int) -> None:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 completions per prompt")
    if not prompt_ids:
        raise ValueError("generate() needs at least one prompt")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. <bos>)")
