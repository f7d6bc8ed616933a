"""The completions a rollout engine returns (`Completions`, layout in `rl_core.rollout.base`), how engines that return
token lists build them (`build_completions`) and how shards of one step join (`concat_completions`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Completions:
    """Sampled completions, ready to become a training batch (layout in `rl_core.rollout.base`'s docstring).

    `finish_reason[j]` is 'stop' when row j sampled EOS (its last response token), else 'length'.
    `response_lengths [N]` counts response tokens including the EOS.
    `policy_version` is the oldest policy that sampled any of its tokens (what the staleness bound checks);
    `token_version [N, P+R]` long, the policy version behind each response token (0 elsewhere), is there only
    when the versions differ (weights updated while sequences decoded, `rollout.in_flight_updates`); without it
    every token is `policy_version`'s. `routes [N, P+R, L, k]` uint8: the experts a mixture-of-experts engine sent
    every token to (`rl_core.model.routing`, `model.routing_replay=rollout`); None when not recorded.
    `earlier_samples`: the samples of agent episodes before each one's last (`rl_core.agents.episode`, "Samples"),
    as completions of their own (`n` as theirs) whose `prompt_index` is the row of the episode they belong to
    (None: no episode started a new sample); the versions, staleness and lags count their tokens too.
    `turn_rewards [N, P+R]` float: agent turns' own rewards (`Reply.reward`) on each turn's last token, 0 elsewhere;
    None when no turn has one.
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
    turn_rewards: torch.Tensor | None = None
    earlier_samples: Completions | None = None
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

    def sampled_versions(self) -> torch.Tensor:
        """`[tokens]` long: the policy version behind each response token, the earlier samples' included."""
        own = self.token_versions()[self.response_mask > 0]
        return own if self.earlier_samples is None else torch.cat([own, self.earlier_samples.sampled_versions()])

    def staleness(self, trainer_version: int) -> tuple[float, int]:
        """`(mean, max)` over the response tokens of `trainer_version` minus the version that sampled the token."""
        versions = self.sampled_versions()
        if not versions.numel():
            lag = int(trainer_version) - int(self.policy_version)
            return float(lag), lag
        lag = int(trainer_version) - versions
        return float(lag.double().mean()), int(lag.max())

    def lag_fractions(self, trainer_version: int, most: int) -> dict[int, float]:
        """`{k: share of the response tokens sampled k versions behind trainer_version}` for k = 0..most."""
        lag = int(trainer_version) - self.sampled_versions()
        total = max(1, lag.numel())
        return {k: float((lag == k).sum()) / total for k in range(most + 1)}

    def earlier_of(self, rows: list[int]) -> Completions | None:
        """The earlier samples of `rows` (`earlier_samples`), renumbered to their rows' places in the list (a row
        listed twice keeps them at its first place)."""
        if self.earlier_samples is None:
            return None
        place: dict[int, int] = {}
        for i, r in enumerate(rows):
            place.setdefault(int(r), i)
        own = [j for j, r in enumerate(self.earlier_samples.prompt_index.tolist()) if r in place]
        if not own:
            return None
        picked = self.earlier_samples.rows(own)
        picked.prompt_index = torch.tensor([place[int(r)] for r in picked.prompt_index.tolist()], dtype=torch.long)
        return picked

    def rows(self, rows: list[int]) -> Completions:
        """These rows (their earlier samples with them, renumbered), `prompt_index` as it was."""
        index = torch.as_tensor(rows, dtype=torch.long)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return Completions(
            input_ids=self.input_ids[index], attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index], sampling_logp=self.sampling_logp[index],
            prompt_index=self.prompt_index[index], finish_reason=[self.finish_reason[i] for i in rows],
            policy_version=self.policy_version, prompt_length=self.prompt_length, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id, n=self.n,
            episodes=None if self.episodes is None else [self.episodes[i] for i in rows],
            token_version=take(self.token_version), routes=take(self.routes), turn_rewards=take(self.turn_rewards),
            earlier_samples=self.earlier_of(rows))

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
    OPTIONAL = ("token_version", "routes", "turn_rewards")

    def _parts(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors and JSON fields `save` writes, names under `prefix` (the earlier samples' under 'earlier.')."""
        import json

        tensors = {prefix + k: getattr(self, k).contiguous() for k in self.TENSORS}
        tensors.update({prefix + k: getattr(self, k).contiguous() for k in self.OPTIONAL if getattr(self, k) is not None})
        meta = {prefix + "fields": json.dumps({k: getattr(self, k) for k in self.SCALARS}, default=str)}
        if self.earlier_samples is not None:
            more, more_meta = self.earlier_samples._parts(prefix + "earlier.")
            tensors.update(more)
            meta.update(more_meta)
        return tensors, meta

    def save(self, path) -> None:
        """Write to a safetensors file (tensors, plus the other fields as JSON metadata): data only, no code."""
        from safetensors.torch import save_file

        tensors, meta = self._parts()
        save_file(tensors, str(path), metadata={"posttrain": "completions", **meta})

    @classmethod
    def load(cls, path) -> Completions:
        """Read what `save` wrote. Only tensors and JSON are parsed (safetensors): a planted file cannot run code.
        A file that is not such a record, or whose fields disagree, raises ValueError."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("posttrain") != "completions":
                raise ValueError(f"{path}: not a posttrain completions record")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open handle has no iteration
        return cls._from_parts(tensors, meta, "", path)

    @classmethod
    def _from_parts(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str], prefix: str, path) -> Completions:
        import json

        try:
            fields = json.loads(meta[prefix + "fields"])
            out = cls(**{k: tensors[prefix + k] for k in cls.TENSORS},
                      **{k: fields[k] for k in cls.SCALARS if k != "episodes"}, episodes=fields.get("episodes"),
                      **{k: tensors.get(prefix + k) for k in cls.OPTIONAL},
                      earlier_samples=cls._from_parts(tensors, meta, prefix + "earlier.", path)
                      if prefix + "earlier.fields" in meta else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a whole completions record ({type(exc).__name__}: {exc})") from None
        rows = out.input_ids.shape[0]
        optional = [getattr(out, k) for k in cls.OPTIONAL]
        if (any(getattr(out, k).shape[0] != rows for k in cls.TENSORS) or len(out.finish_reason) != rows
                or any(v is not None and v.shape[:2] != out.input_ids.shape for v in optional)
                or (out.episodes is not None and len(out.episodes) != rows)
                or (out.earlier_samples is not None and bool((out.earlier_samples.prompt_index >= rows).any()))):
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
        if self.earlier_samples is not None:
            self.earlier_samples.to(device)
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


def concat_completions(parts: list[Completions], index_offsets: list[int] | None = None) -> Completions:
    """Join engines' `Completions` (shards of one step, in prompt order) into one.

    Prompts stay left-padded and responses right-padded to the longest of all shards; the rows,
    masks and log-probs are otherwise unchanged, so the result equals what one engine would return
    for all the prompts. Shards sampled by different policy versions keep each token's
    (`token_version`); the joined `policy_version` is the oldest. Each shard's `prompt_index` moves by the
    prompts before it, or by its `index_offsets` entry when given; their earlier samples join too.
    """
    if not parts:
        raise ValueError("concat_completions needs at least one shard")
    if len(parts) == 1 and index_offsets is None:
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
    offsets = offsets if index_offsets is None else index_offsets
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
        turn_rewards=None if all(p.turn_rewards is None for p in parts) else torch.cat(
            [pad(p, torch.zeros_like(p.sampling_logp) if p.turn_rewards is None else p.turn_rewards, 0.0)
             for p in parts]),
        earlier_samples=_joined_earlier(parts),
    )


def _joined_earlier(parts: list[Completions]) -> Completions | None:
    """The shards' earlier samples, each pointing at its episode's row of the joined completions."""
    shifted, rows = [], 0
    for p in parts:
        if p.earlier_samples is not None:
            shifted.append((p.earlier_samples, rows))
        rows += len(p)
    if not shifted:
        return None
    return concat_completions([e for e, _ in shifted], index_offsets=[o for _, o in shifted])


def _joined_routes(parts: list[Completions], pad) -> torch.Tensor | None:
    """The shards' routes padded like their tokens (`NOT_ROUTED`), or None when no shard recorded any."""
    from rl_core.model.routing import NOT_ROUTED

    if all(p.routes is None for p in parts):
        return None
    if any(p.routes is None for p in parts):
        raise ValueError("engine shards disagree: some recorded mixture-of-experts routes and some did not; every "
                         "engine must run with the same model.routing_replay")
    return torch.cat([pad(p, p.routes, NOT_ROUTED) for p in parts])
