"""HF rollout engine: a batched KV-cache sampling loop over a `transformers` causal LM (CPU or GPU).

Why not `model.generate`: we need the sampling log-prob of every token under exactly the
trainer's formula (`rl_core.primitives.logprobs`: float32 `log_softmax(logits / T)`, positions from
the attention mask), a private seeded generator, and low per-call overhead for the tiny model. The
loop below is a prefill of the left-padded prompts followed by one cached forward per new token.

Per step, every row gets a token; rows that already sampled EOS keep being fed (their pad tokens
are discarded), so the batch shape never changes and the random stream depends only on the seed,
the prompts and the weights.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping

import torch

from rl_core.model import routing
from rl_core.primitives.logprobs import position_ids_from_mask
from rl_core.rollout.base import Completions, RolloutEngine, SamplingParams, check_prompts
from rl_core.rollout.seeds import sampling_seeds


def sample_next_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from `logits [B, V]`; return `(tokens [B] long, logp [B] float32)`.

    `logp = log_softmax(logits / T)[token]` in float32 (T = 1 for greedy at temperature 0): the
    full temperature-scaled distribution, even when `top_p < 1` restricts what is sampled.
    `uniforms [B]` in [0, 1) (one per row, from that row's own seeded stream) picks each row's
    token by inverse CDF, so a row's token depends on its own seed and logits only; without them
    `torch.multinomial` draws from `generator`.
    """
    logp_all = torch.log_softmax(logits.float() / sampling.logprob_temperature, dim=-1)
    if sampling.is_greedy:
        tokens = logp_all.argmax(dim=-1)
    else:
        probs = logp_all.exp()
        if sampling.top_p < 1.0:
            probs = _nucleus(probs, sampling.top_p)
        if uniforms is not None:
            cdf = probs.double().cumsum(-1)
            target = uniforms.to(cdf).unsqueeze(-1) * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        else:
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def row_uniforms(seeds: list[int], steps: int) -> torch.Tensor:
    """`[len(seeds), steps]` float64 uniforms in [0, 1): row j drawn from a generator seeded with `seeds[j]`."""
    out = torch.empty((len(seeds), steps), dtype=torch.float64)
    for j, seed in enumerate(seeds):
        out[j] = torch.rand(steps, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    return out


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches `top_p` (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


class WeightSwap:
    """Forwards and weight loads of one engine, from two threads, one at a time: a load waits for the forward
    running to end, and a forward waits while a load is pending or running (the load goes first), so a weight
    update lands between decoding steps, never inside a forward, and is never starved by the decoding loop."""

    def __init__(self):
        self._cond = threading.Condition()
        self._loading = 0  # loads pending or running
        self._forwards = 0  # forwards running

    @property
    def load_waiting(self) -> bool:
        """A load is pending or running (the next forward waits for it)."""
        with self._cond:
            return bool(self._loading)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._loading and not self._forwards)
            self._forwards += 1
        try:
            yield
        finally:
            with self._cond:
                self._forwards -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        with self._cond:
            self._loading += 1
            try:
                self._cond.wait_for(lambda: not self._forwards)
            except BaseException:
                self._loading -= 1
                raise
        try:
            yield
        finally:
            with self._cond:
                self._loading -= 1
                self._cond.notify_all()


class HFEngine(RolloutEngine):
    """Rollout engine over an in-memory `transformers` causal LM.

    `model` is used in place (eval mode, no grad); `update_weights` copies a state dict into it.
    `seed` seeds the engine's own generator, used when `SamplingParams.seed` is None.
    `compute_dtype` ("float32"/"bfloat16", None: the model's own): when it is narrower than the
    model's parameters (a float32 trainer model shared with a bf16 run), forwards run under autocast.

    A weight update from another thread (`update_weights`, or a load inside `swap.load()`) lands between two
    decoding steps of a `generate` in flight (`WeightSwap`): the sequences go on, their KV cache as computed, and
    every later token carries the new version (`Completions.token_version`).

    `record_routes` (`model.routing_replay=rollout`, a mixture-of-experts model): every forward records the
    experts its routers chose, returned as `Completions.routes` (`rl_core.model.routing`).
    """

    def __init__(self, model, tokenizer, *, seed: int = 0, policy_version: int = 0,
                 compute_dtype: str | None = None, record_routes: bool = False):
        self.model = model
        self.record_routes = record_routes
        self.compute_dtype = compute_dtype
        self.tokenizer = tokenizer
        self.eos_token_id = _single_id(tokenizer.eos_token_id, "eos_token_id")
        pad = tokenizer.pad_token_id
        self.pad_token_id = self.eos_token_id if pad is None else int(pad)
        # EOS of the tokenizer plus any extra stop ids of the model's generation config
        # (chat models often end turns with a second id, e.g. Qwen's <|im_end|>).
        stop = {self.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            stop.update(int(x) for x in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
        self.stop_token_ids = sorted(stop)
        self._version = int(policy_version)
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed))
        self.swap = WeightSwap()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def policy_version(self) -> int:
        return self._version

    def set_policy_version(self, version: int) -> None:
        """The engine samples from the trainer's own model (colocated): only the version moves."""
        self._version = int(version)

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copy `weights` into the model (strict: every key must match) and set the policy version."""
        state_dict = weights if isinstance(weights, Mapping) else dict(weights)
        with self.swap.load():
            missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
            self._version = int(version)
        # A tied lm_head may be absent from the trainer's dict; anything else is an error.
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise KeyError(
                f"update_weights: state dict does not match the rollout model (missing={missing[:5]}, "
                f"unexpected={list(unexpected)[:5]}); send the policy's own model.state_dict()"
            )

    def held_weights(self, probe: list[int]) -> dict:
        """Sums of every tensor of the model as it holds them, and its log-probs of `probe` (`rl_core.rollout.verify`)."""
        from rl_core.rollout.verify import probe_logprobs, tensor_sums

        with self.swap.forward(), self._autocast(self.device):
            logp = probe_logprobs(self.model, probe)
        return {"sums": tensor_sums(self.model.state_dict()), "probe_logp": logp}

    @torch.no_grad()  # not inference_mode: the returned tensors feed autograd in the trainer
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                 prompt_offset: int = 0) -> Completions:
        """Sample `n` completions per prompt (rows of prompt i are contiguous)."""
        check_prompts(prompt_ids, n)
        model, device = self.model, self.device
        was_training = model.training
        model.eval()
        started = time.perf_counter()
        try:
            with self._autocast(device):
                return self._generate(prompt_ids, n, sampling, model, device, prompt_offset)
        finally:
            self.last_generate_s = time.perf_counter() - started
            model.train(was_training)

    def _autocast(self, device: torch.device):
        param_dtype = next(self.model.parameters()).dtype
        if self.compute_dtype in (None, "float32") or param_dtype != torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=getattr(torch, self.compute_dtype))

    def _generate(self, prompt_ids, n, sampling, model, device, prompt_offset) -> Completions:
        generator, uniforms = self._generator, None
        P = max(len(p) for p in prompt_ids)
        rows = len(prompt_ids) * n
        if (seeds := sampling_seeds(sampling, prompt_offset, len(prompt_ids), n)) is not None:
            uniforms = row_uniforms(seeds, sampling.max_tokens).to(device)
        prompt = torch.full((len(prompt_ids), P), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            prompt[i, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            prompt_mask[i, P - len(p) :] = 1
        prompt = prompt.repeat_interleave(n, dim=0).to(device)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0).to(device)

        max_tokens = sampling.max_tokens
        tokens = torch.full((rows, max_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((rows, max_tokens), dtype=torch.float32, device=device)
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # no EOS sampled yet
        lengths = torch.zeros(rows, dtype=torch.long, device=device)

        positions = position_ids_from_mask(prompt_mask)
        versions = []  # the policy version of the forward behind each decoding position's logits
        routes = []  # recording: per forward, the [rows, positions, L, k] experts of the tokens it fed
        with self.swap.forward(), self._routes(routes, rows):
            versions.append(self._version)
            out = model(
                input_ids=prompt,
                attention_mask=prompt_mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_pos = positions[:, -1:] + 1
        mask = prompt_mask
        stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)
        for t in range(max_tokens):
            tok, lp = sample_next_tokens(logits, sampling, generator, None if uniforms is None else uniforms[:, t])
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_token_id))
            tokens[:, t] = tok
            logps[:, t] = torch.where(alive, lp, torch.zeros_like(lp))
            lengths += alive.long()
            alive = alive & ~torch.isin(tok, stop_ids)
            if t + 1 == max_tokens or not bool(alive.any()):
                break
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
            with self.swap.forward(), self._routes(routes, rows):  # a weight update waits for it, or it for the update
                versions.append(self._version)
                out = model(
                    input_ids=tok.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=next_pos,
                    past_key_values=cache,
                    use_cache=True,
                )
            cache, logits = out.past_key_values, out.logits[:, -1]
            next_pos = next_pos + 1

        R = max(1, int(lengths.max()))
        tokens, logps = tokens[:, :R].cpu(), logps[:, :R].cpu()
        lengths = lengths.cpu()
        resp_mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).float()
        tokens = torch.where(resp_mask.bool(), tokens, torch.full_like(tokens, self.pad_token_id))
        stopped = torch.isin(tokens, stop_ids.cpu()) & resp_mask.bool()
        finish = ["stop" if s else "length" for s in stopped.any(-1).tolist()]
        token_version = None
        if len(set(versions[:R])) > 1:  # weights changed while these sequences decoded: each token's own version
            per_position = torch.tensor(versions[:R], dtype=torch.long).expand(rows, R) * resp_mask.long()
            token_version = torch.cat([torch.zeros((rows, P), dtype=torch.long), per_position], dim=1)
        recorded = None
        if routes:  # the last token is fed by no forward; padding's routes are nobody's
            fed = torch.cat(routes, 1)[:, :P + R]
            recorded = torch.full((rows, P + R, *fed.shape[2:]), routing.NOT_ROUTED, dtype=routing.ROUTE_DTYPE)
            recorded[:, :fed.shape[1]] = fed
            recorded[~torch.cat([prompt_mask.cpu(), resp_mask.long()], dim=1).bool()] = routing.NOT_ROUTED
        return Completions(
            input_ids=torch.cat([prompt.cpu(), tokens], dim=1),
            attention_mask=torch.cat([prompt_mask.cpu(), resp_mask.long()], dim=1),
            response_mask=torch.cat([torch.zeros((rows, P)), resp_mask], dim=1),
            sampling_logp=torch.cat([torch.zeros((rows, P)), logps * resp_mask], dim=1),
            prompt_index=torch.arange(len(prompt_ids)).repeat_interleave(n),
            finish_reason=finish,
            policy_version=versions[0],
            prompt_length=P,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            n=n,
            token_version=token_version,
            routes=recorded,
        )

    @contextlib.contextmanager
    def _routes(self, out: list, rows: int) -> Iterator[None]:
        """Around one forward of `rows` rows: with `record_routes`, append what its routers chose to `out`."""
        if not self.record_routes:
            yield
            return
        with routing.capture(self.model) as fwd:
            yield
        chosen = routing.stacked(fwd).cpu()
        out.append(chosen.reshape(rows, -1, *chosen.shape[1:]))


def _single_id(value, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"tokenizer has no {name}")
        value = value[0]
    if value is None:
        raise ValueError(f"tokenizer has no {name}; the rollout engine needs one to end completions")
    return int(value)
