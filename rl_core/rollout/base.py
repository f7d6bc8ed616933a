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

Multi-turn episodes (`rl_core.agents`) use the same layout with holes in the response mask: after the opening prompt
come the policy's turns and the environment's messages, and `response_mask` is 1 on the sampled tokens only.
`episodes` then holds one JSON record per row: the conversation (`prompt` messages, `completion` messages with tool
calls and results), the environment's `reward` and the episode's counts (`stats`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from rl_core.rollout.completions import Completions, build_completions, concat_completions

__all__ = ["Completions", "RolloutEngine", "SamplingParams", "build_completions", "check_prompts", "concat_completions"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `greedy=True` (or `temperature == 0`) takes the argmax token.

    `seed`: the step's sampling seed. Every completion gets its own seed derived from it, from its prompt's position
    in the step's whole batch and from its sample index (`rl_core.rollout.seeds`), so a completion depends only on (seed,
    prompt position, sample index, prompt, weights): the same whatever the number of engines the prompts were
    sharded across (`generate(..., prompt_offset=)` gives the shard's first position). Global RNG state is never
    read. `None` uses the engine's own generator, which advances from call to call.

    `row_seeds`: one seed per completion row of the call, given by the caller instead of derived from `seed` (agent
    episodes: each row is one episode's next turn, seeded by the episode and the turn, `rl_core.agents.scheduling`,
    whatever else shares the call). Needs `seed` set (it names the draw) and `n=1`.

    `top_p < 1` samples from the nucleus, but `sampling_logp` stays the log-prob under the full temperature-scaled
    distribution — the quantity the trainer computes — so it is not the probability with which the token was
    actually drawn (preflight warns about this under ratio-based surrogates).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    greedy: bool = False
    row_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.row_seeds is not None and self.seed is None:
            raise ValueError("row_seeds need seed set too (a draw without a seed uses the engine's own generator)")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the returned log-probs: T, or 1 when greedy with temperature 0."""
        return self.temperature if self.temperature > 0 else 1.0


class RolloutEngine(abc.ABC):
    """Samples completions from the current policy weights.

    `last_generate_s`: seconds the most recent `generate` call spent sampling (for perf metrics).
    `generate(prompt_ids, n, sampling, prompt_offset=0)`: `prompt_ids` are unpadded token-id lists (as the
    tokenizer returns them, special tokens included); returns `n` completions per prompt. `prompt_offset` is the
    position of `prompt_ids[0]` in the step's whole batch when the prompts are a shard of it (seeds per completion,
    see `SamplingParams`).
    `update_weights(state_dict, version)`: load the trainer's weights; later completions carry `policy_version ==
    version`. `sleep()` / `wake()`: free and take back the engine's memory around a colocated training step (a
    no-op where the engine cannot).
    `held_weights(probe)`: what the engine holds after a load, for the driver to check against the trainer
    (`rl_core.rollout.verify`): per-tensor float64 sums of the weights it can read back, keyed by HF names,
    and its own log-probs of the token sequence `probe`.
    """

    last_generate_s: float = 0.0

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                 prompt_offset: int = 0) -> Completions: ...

    def sleep(self) -> None:
        """Release memory while the trainer steps (colocated placement)."""

    def wake(self) -> None:
        """Take the memory back before the next rollout."""

    @abc.abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Load the policy's weights (HF names: a state dict, or `(name, tensor)` pairs read once, in order, as
        they arrive) and move to policy `version`."""

    @abc.abstractmethod
    def held_weights(self, probe: list[int]) -> dict: ...

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
