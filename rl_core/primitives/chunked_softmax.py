"""The float32 log-softmax of a causal LM's logits at the read tokens, chunk by chunk (`token_logprobs_and_entropy`):
each chunk's `[chunk, V]` float32 values made, reduced to log-prob and entropy, and dropped, recomputed in backward,
so no `[K, V]` float32 tensor exists beside the logits. `rl_core.primitives.logprobs` fuses the same chunk functions
with the LM head."""

from __future__ import annotations

import torch

# float32 elements of one chunk of the log-softmax: with a 151,936-token vocabulary, 110 positions (64 MiB)
CHUNK_ELEMENTS = 16 * 1024 * 1024


class _TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits / T)[target]` and the entropy of `softmax(logits / T)`, `[K, V]` -> `[K]`, `[K]` float32.

    Forward and backward walk the rows in chunks of `chunk` rows, so the float32 temporaries are
    `[chunk, V]` (`chunk_logprobs`, `chunk_logit_grad`); autograd keeps only the logits (already alive)
    and the `[K]` log-normalisers. The entropy is a diagnostic: it carries no gradient.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy):
        k = logits.shape[0]
        logp = torch.empty(k, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
        for s in range(0, k, chunk):
            chunk_logprobs(scaled(logits[s:s + chunk], temperature), targets[s:s + chunk], s, lse, logp, entropy)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        in_place = grad.dtype == torch.float32  # write the float32 result straight into the gradient
        for s in range(0, logits.shape[0], chunk):
            d = chunk_logit_grad(scaled(logits[s:s + chunk], t), lse[s:s + chunk], targets[s:s + chunk],
                                  grad_logp[s:s + chunk], t, out=grad[s:s + chunk] if in_place else None)
            if not in_place:
                grad[s:s + chunk] = d
        return grad, None, None, None, None


def chunk_logprobs(x: torch.Tensor, targets: torch.Tensor, start: int, lse: torch.Tensor, logp: torch.Tensor,
                    entropy: torch.Tensor) -> None:
    """One chunk, `x = logits / T` `[c, V]` float32 (not written to): its log-normalisers, the targets' log-probs
    and (when `entropy` is not empty) entropies, written at `start` of the `[K]` outputs. One exponential
    pass: `e = exp(x - max)`, `lse = max + log Σe`, `H = lse - Σ e·x / Σ e`."""
    end = start + x.shape[0]
    top = x.amax(-1, keepdim=True)
    e = torch.sub(x, top).exp_()
    total = e.sum(-1)
    lse[start:end] = top.squeeze(-1) + total.log()
    logp[start:end] = x.gather(-1, targets[:, None]).squeeze(-1) - lse[start:end]
    if entropy.numel():
        entropy[start:end] = lse[start:end] - e.mul_(x).sum(-1) / total


def chunk_logit_grad(x: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                      temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """∂(Σ g · logp)/∂logits of one chunk: `(onehot(target) - softmax(x)) · g / T`, `[c, V]` float32 (into `out`)."""
    g = grad_logp[:, None].float()
    d = torch.sub(x, lse[:, None], out=out).exp_().mul_(-g).scatter_add_(-1, targets[:, None], g)
    return d.div_(temperature) if temperature != 1.0 else d


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / T` in float32: the logits themselves at T = 1 (never written to), else a new tensor."""
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, *,
                               with_entropy: bool = False, chunk: int | None = None):
    """Chunked float32 `log_softmax(logits / T)[targets]` (and entropy). logits `[K, V]`, targets `[K]` -> `[K]`, `[K]`."""
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // max(int(logits.shape[-1]), 1))
    return _TokenLogprobs.apply(logits, targets, float(temperature), int(chunk), bool(with_entropy))
