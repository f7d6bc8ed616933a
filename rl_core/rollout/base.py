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
from dataclasses import dataclass, field

import torch


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


@dataclass
class Completions:
    """Sampled completions, ready to become a training batch (layout in the module docstring).

    `finish_reason[j]` is 'stop' when row j sampled EOS (its last response token), else 'length'.
    `response_lengths [N]` counts response tokens including the EOS.
    `policy_version` is the oldest policy that sampled any of its tokens (what the staleness bound checks);
    `token_version [N, P+R]` long, the policy version behind each response token (0 elsewhere), is there only
    when the versions differ (weights updated while sequences decoded, `rollout.in_flight_updates`); without it
    every token is `policy_version`'s. `routes [N, P+R, L, k]` uint8: the experts a mixture-of-experts engine sent
    every token to (`rl_core.model.routing`, `model.routing_replay=rollout`); None when not recorded.
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
    episodes: list[dict] | None = None
    token_version: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    response_lengths: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.response_lengths = self.response_mask.sum(-1).long()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        return len(self) // self.n

    def token_versions(self) -> torch.Tensor:
        """`[N, P+R]` long: the policy version behind each response token (0 elsewhere)."""
        if self.token_version is not None:
            return self.token_version
        return (self.response_mask > 0).long() * int(self.policy_version)

    def staleness(self, trainer_version: int) -> tuple[float, int]:
        """`(mean, max)` over the response tokens of `trainer_version` minus the version that sampled the token."""
        on = self.response_mask > 0
        if self.token_version is None or not bool(on.any()):
            lag = int(trainer_version) - int(self.policy_version)
            return float(lag), lag
        lag = int(trainer_version) - self.token_version[on]
        return float(lag.double().mean()), int(lag.max())

    def lag_fractions(self, trainer_version: int, most: int) -> dict[int, float]:
        """`{k: share of the response tokens sampled k versions behind trainer_version}` for k = 0..most."""
        on = self.response_mask > 0
        lag = int(trainer_version) - self.token_versions()[on]
        total = max(1, int(on.sum()))
        return {k: float((lag == k).sum()) / total for k in range(most + 1)}

    def response_token_ids(self, include_eos: bool = False) -> list[list[int]]:
        """The sampled token ids of each row (the response mask's), up to the first EOS (included only if asked);
        a multi-turn row's turns one after the other."""
        out = []
        for row, mask, reason in zip(self.input_ids, self.response_mask, self.finish_reason):
            ids = row[mask > 0].tolist()
            if reason == "stop" and not include_eos:
                ids = ids[:-1]
            out.append(ids)
        return out

    def decode_responses(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Response text of each row, up to (not including) the first EOS."""
        return tokenizer.batch_decode(self.response_token_ids(), skip_special_tokens=skip_special_tokens)

    TENSORS = ("input_ids", "attention_mask", "response_mask", "sampling_logp", "prompt_index")
    SCALARS = ("finish_reason", "policy_version", "prompt_length", "eos_token_id", "pad_token_id", "n", "episodes")
    OPTIONAL = ("token_version", "routes")

    def save(self, path) -> None:
        """Write to a safetensors file (tensors, plus the other fields as JSON metadata): data only, no code."""
        import json

        from safetensors.torch import save_file

        meta = {"posttrain": "completions",
                "fields": json.dumps({k: getattr(self, k) for k in self.SCALARS}, default=str)}
        tensors = {k: getattr(self, k).contiguous() for k in self.TENSORS}
        for name in self.OPTIONAL:
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name).contiguous()
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path) -> Completions:
        """Read what `save` wrote. Only tensors and JSON are parsed (safetensors): a planted file cannot run code.
        A file that is not such a record, or whose fields disagree, raises ValueError."""
        import json

        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("posttrain") != "completions":
                raise ValueError(f"{path}: not a posttrain completions record")
            tensors = {k: f.get_tensor(k) for k in cls.TENSORS}
            names = set(f.keys())  # a safe_open handle has no `in`
            optional = {k: f.get_tensor(k) if k in names else None for k in cls.OPTIONAL}
        fields = json.loads(meta["fields"])
        out = cls(**tensors, **{k: fields[k] for k in cls.SCALARS if k != "episodes"}, episodes=fields.get("episodes"),
                  **optional)
        rows = out.input_ids.shape[0]
        if (any(getattr(out, k).shape[0] != rows for k in cls.TENSORS) or len(out.finish_reason) != rows
                or any(v is not None and v.shape[:2] != out.input_ids.shape for v in optional.values())
                or (out.episodes is not None and len(out.episodes) != rows)):
            raise ValueError(f"{path}: its fields disagree on the number of rows")
        return out

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
        for name in self.OPTIONAL:
            if getattr(self, name) is not None:
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
    stop_token_ids: list[int] | None = None,
) -> Completions:
    """Assemble `Completions` from per-row response tokens (engines that return lists, e.g. vLLM).

    `responses[j]` / `response_logps[j]` belong to prompt `j // n`; a response is cut after its
    first stop token (`eos_token_id` and any of `stop_token_ids`, e.g. a chat model's end-of-turn
    id; tokens after it are dropped); finish reason is 'stop' iff a stop token was kept.
    """
    rows = len(prompt_ids) * n
    if len(responses) != rows or len(response_logps) != rows:
        raise ValueError(
            f"expected {rows} responses ({len(prompt_ids)} prompts x n={n}), got {len(responses)}"
        )
    stops = {int(eos_token_id), *(int(t) for t in (stop_token_ids or ()))}
    cut, cut_lp, reasons = [], [], []
    for toks, lps in zip(responses, response_logps):
        toks, lps = list(toks)[:max_tokens], list(lps)[:max_tokens]
        first_stop = next((i for i, t in enumerate(toks) if t in stops), None)
        if first_stop is not None:
            k = first_stop + 1
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


def concat_completions(parts: list[Completions]) -> Completions:
    """Join engines' `Completions` (shards of one step, in prompt order) into one.

    Prompts stay left-padded and responses right-padded to the longest of all shards; the rows,
    masks and log-probs are otherwise unchanged, so the result equals what one engine would return
    for all the prompts. Shards sampled by different policy versions keep each token's
    (`token_version`); the joined `policy_version` is the oldest.
    """
    if not parts:
        raise ValueError("concat_completions needs at least one shard")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        if (p.n, p.eos_token_id, p.pad_token_id) != (first.n, first.eos_token_id, first.pad_token_id):
            raise ValueError(
                "engine shards disagree on n or eos/pad ids "
                f"({first.n}, {first.eos_token_id}, {first.pad_token_id}) vs "
                f"({p.n}, {p.eos_token_id}, {p.pad_token_id}): every engine must serve the same model and request"
            )
    P = max(p.prompt_length for p in parts)
    R = max(p.input_ids.shape[1] - p.prompt_length for p in parts)

    def pad(p: Completions, t: torch.Tensor, value) -> torch.Tensor:
        left, right = P - p.prompt_length, R - (t.shape[1] - p.prompt_length)
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (left, right), value=value)

    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += p.num_prompts
    # shards started on different versions (an engine took new weights between two calls): per-token versions
    mixed = len({p.policy_version for p in parts}) > 1 or any(p.token_version is not None for p in parts)
    return Completions(
        input_ids=torch.cat([pad(p, p.input_ids, p.pad_token_id) for p in parts]),
        attention_mask=torch.cat([pad(p, p.attention_mask, 0) for p in parts]),
        response_mask=torch.cat([pad(p, p.response_mask, 0.0) for p in parts]),
        sampling_logp=torch.cat([pad(p, p.sampling_logp, 0.0) for p in parts]),
        prompt_index=torch.cat([p.prompt_index + off for p, off in zip(parts, offsets)]),
        finish_reason=[r for p in parts for r in p.finish_reason],
        policy_version=min(p.policy_version for p in parts),
        prompt_length=P,
        eos_token_id=first.eos_token_id,
        pad_token_id=first.pad_token_id,
        n=first.n,
        episodes=None if any(p.episodes is None for p in parts) else [e for p in parts for e in p.episodes],
        token_version=torch.cat([pad(p, p.token_versions(), 0) for p in parts]) if mixed else None,
        routes=_joined_routes(parts, pad),
    )


def _joined_routes(parts: list[Completions], pad) -> torch.Tensor | None:
    """The shards' routes padded like their tokens (`NOT_ROUTED`), or None when no shard recorded any."""
    from rl_core.model.routing import NOT_ROUTED

    if all(p.routes is None for p in parts):
        return None
    if any(p.routes is None for p in parts):
        raise ValueError("engine shards disagree: some recorded mixture-of-experts routes and some did not; every "
                         "engine must run with the same model.routing_replay")
    return torch.cat([pad(p, p.routes, NOT_ROUTED) for p in parts])


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
