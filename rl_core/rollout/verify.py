"""What a weight sync is verified by: the weights as the engine holds them, and its log-probs of a fixed probe.

After an engine loads a policy version it reports (`RolloutEngine.held_weights`):

- `sums`: per tensor it can read back, `(sum, sum of |x|)` in float64 of the values as it holds them, keyed by
  the HF names the tensor holds (`"a+b+c"` for a tensor vLLM fuses from several: the sums of a concatenation
  are the sums of its parts). Tensors an engine cannot read back are left out: vLLM's CPU build repacks every
  linear layer's weight into oneDNN's own layout and empties the parameter.
- `probe_logp`: the log-probs (T = 1) of every token after the first of `probe_ids(...)`, a fixed sequence,
  computed by the engine's own forward: this covers every weight, readable or not.

The trainer reports the same from the weights it sent (cast to the engines' dtype) and from its own forward,
and `compare_held` names what differs, worst first. Tolerances: sums are float64 over identical values, so
they agree to rounding (`SUM_RTOL` of the tensor's sum of |x|); log-probs come from two implementations and,
in bfloat16, from weights rounded differently (`PROBE_ATOL`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

SUM_RTOL = 1e-6  # float64 sums of the same values in another order (a fused tensor, another device)
# the largest |engine - trainer| log-prob of a probe token: float32 engines agree to ~1e-6 (the flows' own
# rollout/logp_abs_diff); a bfloat16 engine against the trainer's float32 master weights under bf16 autocast
# differs by rounding of weights and activations
PROBE_ATOL = {"float32": 1e-4, "bfloat16": 0.25}
PROBE_LENGTH = 24


def probe_ids(vocab_size: int, max_model_len: int | None = None) -> list[int]:
    """A fixed token sequence over the whole vocabulary (the same on every engine and the trainer): `PROBE_LENGTH`
    tokens, fewer when the engines' `max_model_len` is shorter (vLLM generates one token after it)."""
    length = PROBE_LENGTH if max_model_len is None else max(1, min(PROBE_LENGTH, int(max_model_len) - 1))
    return [(7919 * i + 13) % int(vocab_size) for i in range(length)]


SUM_CHUNK = 1 << 22  # elements summed at a time: the extra memory of a sum is one chunk in the engines' dtype


def tensor_sum(value: torch.Tensor, dtype: torch.dtype | None = None,
               chunk: int = SUM_CHUNK) -> tuple[float, float]:
    """`(sum, sum of |x|)` in float64 of `value` cast to `dtype` first (the engines' dtype), accumulated in float64
    chunk by chunk: no float64 copy of the tensor is made, and at most `chunk` elements of it are cast (or made
    absolute) at a time, so the sums of a 7B model's embedding need megabytes, not gigabytes, beside it."""
    flat = value.detach().reshape(-1)  # a view when contiguous
    total = magnitude = 0.0
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk]
        if dtype is not None and part.dtype != dtype:
            part = part.to(dtype)
        total += float(part.sum(dtype=torch.float64))
        magnitude += float(part.abs().sum(dtype=torch.float64))
    return total, magnitude


def tensor_sums(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None) -> dict[str, tuple[float, float]]:
    """`name -> tensor_sum(...)` of a state dict, or of `(name, tensor)` pairs as they stream past."""
    pairs = state.items() if isinstance(state, Mapping) else state
    return {name: tensor_sum(value, dtype) for name, value in pairs}


def summed(pairs: Iterable[tuple[str, torch.Tensor]], sums: dict[str, tuple[float, float]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """`pairs` passed through, recording each tensor's `tensor_sum` into `sums` as it goes by."""
    for name, value in pairs:
        sums[name] = tensor_sum(value)
        yield name, value


def fused_name(name: str, packed: dict[str, list[str]]) -> str:
    """The HF names an engine tensor holds, joined with '+': `...qkv_proj.weight` (vLLM's fusion of q, k, v)
    -> `...q_proj.weight+...k_proj.weight+...v_proj.weight`; other names unchanged."""
    for fused, parts in packed.items():
        tag = f".{fused}."
        if tag in name:
            return "+".join(name.replace(tag, f".{part}.") for part in parts)
    return name


def probe_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The log-probs of `ids[1:]` under `model` (T = 1), the trainer's formula (`sequence_token_logprobs`)."""
    from rl_core.primitives.logprobs import sequence_token_logprobs

    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lp = sequence_token_logprobs(model, input_ids, torch.ones_like(input_ids), temperature=1.0)
    finally:
        model.train(was_training)
    return [float(x) for x in lp[0, 1:].float().cpu()]


def probe_gap(expected: dict, held: dict) -> float:
    """The largest |engine - trainer| log-prob over the probe's tokens (inf when their lengths differ)."""
    want, got = expected["probe_logp"], held["probe_logp"]
    if len(want) != len(got):
        return float("inf")
    return max((abs(a - b) for a, b in zip(got, want)), default=0.0)


def compare_held(expected: dict, held: dict, dtype: str) -> list[str]:
    """What differs between the trainer's report (`expected`) and an engine's (`held`), worst first; [] if nothing.

    Each engine tensor's sums against the sum of the trainer's tensors it holds (relative to their sum of |x|; an
    engine tensor whose names the trainer did not send is not compared), then the probe's log-probs
    (`PROBE_ATOL[dtype]`).
    """
    found: list[tuple[float, str]] = []
    sent = expected["sums"]
    for key, (total, magnitude) in held["sums"].items():
        names = key.split("+")
        if any(n not in sent for n in names):
            continue  # a name vLLM gives otherwise than HF (a renaming architecture, a quantization scale): the probe covers it
        want = sum(sent[n][0] for n in names)
        want_magnitude = sum(sent[n][1] for n in names)
        scale = max(want_magnitude, 1e-30)
        error = max(abs(total - want), abs(magnitude - want_magnitude)) / scale
        if not error <= SUM_RTOL:  # NaN fails too
            text = (f"tensor {key}: sum {total:.9g} (|x| sum {magnitude:.9g}) where the trainer sent {want:.9g} "
                    f"({want_magnitude:.9g}): off by {error:.3g} of its magnitude")
            found.append((error, text))
    probe: list[str] = []
    want_lp, got_lp = expected["probe_logp"], held["probe_logp"]
    if len(want_lp) != len(got_lp):
        probe.append(f"probe: {len(got_lp)} log-probs where the trainer has {len(want_lp)}")
    else:
        atol = PROBE_ATOL[dtype]
        gaps = [abs(a - b) for a, b in zip(got_lp, want_lp)]
        bad = [i for i, g in enumerate(gaps) if not g <= atol]  # NaN fails too
        worst = max(bad, key=lambda i: gaps[i] if gaps[i] == gaps[i] else float("inf")) if bad else 0
        if bad:
            probe.append(f"probe log-probs: token {worst + 1} of the fixed probe has log-prob {got_lp[worst]:.6g} on "
                         f"the engine, {want_lp[worst]:.6g} on the trainer (|diff| {gaps[worst]:.3g} > {atol:g} for {dtype})")
    found.sort(key=lambda item: -item[0])  # the worst tensor first; the probe (which every bad tensor moves) last
    return [text for _, text in found] + probe
