"""Per-token log-probs of a causal LM: the one place the trainer and the rollout engines agree on.

`ℓ_t = log_softmax(logits_{t-1} / T)[x_t]`, in float32, for the positions a loss or score reads.

The batch arrives in the rollout layout (`[B, T]`, left-padded prompts, padding after EOS), and the
result is returned in it (`[B, T]`, 0 where nothing was read), but the model never sees padding:

- **Unpadded forward.** The real tokens of every row (`attention_mask == 1`) are moved into one of
  two layouts with their own positions `0 .. len-1` (what `generate` gives them):
  `rows` — each row left-aligned, the micro-batch only as wide as its longest row, pure causal
  attention and no mask (a row's trailing padding comes after all of its real tokens, so no real
  token attends to it); `packed` — every row back to back in one sequence with per-row position ids,
  for attention kernels that read sequence boundaries from them (`flash_attention_*`, varlen).
  `padded` runs the rollout layout as it is, with the mask: the reference for parity checks.
- **Log-probs only where read.** Hooks on the LM head keep only the hidden states whose next token is
  read (the loss mask; every real token by default) and, for a plain linear head, fuse it with the
  float32 log-softmax and entropy (`_FusedHeadLogprobs`): chunk by chunk, each chunk's logits made,
  reduced and dropped, recomputed in backward. No `[B, T, V]` nor `[K, V]` tensor exists. A head the
  model post-processes (softcapping, logit scaling) returns the `[K, V]` logits of the read tokens,
  reduced by the same chunked function (`token_logprobs_and_entropy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass

import torch

from rl_core.model import routing
from rl_core.primitives import chunked_softmax
from rl_core.primitives.chunked_softmax import (
    chunk_logit_grad,
    chunk_logprobs,
    scaled,
    token_logprobs_and_entropy,
)

FORWARD_LAYOUTS = ("rows", "packed", "padded")

_layout: contextvars.ContextVar[str | None] = contextvars.ContextVar("posttrain_forward_layout", default=None)


@contextlib.contextmanager
def forward_layout(name: str):
    """Force the forward layout of `sequence_token_logprobs` inside the block (parity checks, benchmarks)."""
    if name not in FORWARD_LAYOUTS:
        raise ValueError(f"forward layout {name!r}; expected one of {FORWARD_LAYOUTS}")
    token = _layout.set(name)
    try:
        yield
    finally:
        _layout.reset(token)


def default_layout(model: torch.nn.Module) -> str:
    """`packed` when the model's attention reads sequence boundaries from position ids (flash attention), else `rows`."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
    return "packed" if impl.startswith("flash_attention") else "rows"


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: `cumsum(mask) - 1`, clamped at 0. Shape `[B, T]`."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


# ------------------------------------------------------------------------------------ layouts


@dataclass
class UnpaddedBatch:
    """The real tokens of a `[B, T]` batch in an unpadded layout, and where to find the read positions.

    `input_ids`/`position_ids`: what the model sees (`[B, L]` for rows, `[1, N]` for packed).
    `rows`, `cols`: the read positions t of the original batch (`[K]` each); `source`: the flat index,
    in the model's layout, of the token before each of them (whose logits predict it); `targets`:
    the token ids read (`[K]`). `real`: `(rows, cols)` of every real token, `flat` its index in the model's layout
    (what moves per-token model inputs, the MoE routes, into it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    rows: torch.Tensor
    cols: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor
    real: tuple[torch.Tensor, torch.Tensor]
    flat: torch.Tensor


def read_positions(attention_mask: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """`[B, T]` bool: the positions whose log-prob is computed (never position 0).

    The loss mask when given, else every real token whose predecessor is real. A read token must
    follow a real token of its row (the rollout layout guarantees it: a prompt precedes every response).
    """
    real = attention_mask.bool()
    read = torch.zeros_like(real)
    if loss_mask is None:
        read[:, 1:] = real[:, 1:] & real[:, :-1]
        return read
    read[:, 1:] = loss_mask[:, 1:] != 0
    if bool((loss_mask[:, 0] != 0).any()) or bool((read[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("loss_mask marks a token that follows no real token of its row (position 0, or right after "
                         "padding): nothing predicts it; every response must follow a prompt")
    return read


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, read: torch.Tensor, layout: str) -> UnpaddedBatch:
    """Move the real tokens of `input_ids [B, T]` into the `rows` or `packed` layout (module docstring)."""
    real = attention_mask.bool()
    lengths = real.sum(-1)
    col = real.long().cumsum(-1) - 1  # position of each real token within its row's real tokens
    b_real, t_real = real.nonzero(as_tuple=True)
    b_read, t_read = read.nonzero(as_tuple=True)
    if layout == "rows":
        width = max(int(lengths.max()), 1) if lengths.numel() else 1
        ids = input_ids.new_zeros(input_ids.shape[0], width)
        ids[b_real, col[b_real, t_real]] = input_ids[b_real, t_real]
        source = b_read * width + col[b_read, t_read] - 1
        positions = torch.arange(width, device=ids.device).expand_as(ids)
        return UnpaddedBatch(ids, positions, b_read, t_read, source, input_ids[b_read, t_read], (b_real, t_real),
                             b_real * width + col[b_real, t_real])
    if layout != "packed":
        raise ValueError(f"unpad layout {layout!r}; expected 'rows' or 'packed'")
    offset = lengths.cumsum(0) - lengths
    ids = input_ids[b_real, t_real][None]
    positions = col[b_real, t_real][None]
    source = offset[b_read] + col[b_read, t_read] - 1
    return UnpaddedBatch(ids, positions, b_read, t_read, source, input_ids[b_read, t_read], (b_real, t_real),
                         offset[b_real] + col[b_real, t_real])


class _FusedHeadLogprobs(torch.autograd.Function):
    """The LM head and `token_logprobs_and_entropy` in one: hidden `[K, H]`, head weight `[V, H]` -> `[K]`, `[K]`.

    Each chunk's logits are computed, reduced to log-prob, log-normaliser and entropy, and dropped;
    backward recomputes them chunk by chunk. No `[K, V]` tensor exists, only `[chunk, V]` float32
    temporaries. The matmuls run in the autocast dtype when autocast is on (as the head would), the
    softmax in float32; the weight's gradient is accumulated in float32, when the weight requires one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else weight.dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        k = hidden.shape[0]
        logp = torch.empty(k, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, k, chunk):
                x = scaled(torch.nn.functional.linear(hidden[s:s + chunk].to(dtype), w, b), temperature)
                chunk_logprobs(x, targets[s:s + chunk], s, lse, logp, entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        # a frozen head (LoRA, or a scorer's no-grad model) gets no float32 weight-gradient accumulator
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk]
                x = scaled(torch.nn.functional.linear(h.to(dtype), w, b), t)
                d = chunk_logit_grad(x, lse[s:s + chunk], targets[s:s + chunk], grad_logp[s:s + chunk], t, out=x)
                grad_hidden[s:s + chunk] = (d.to(dtype) @ w).to(hidden.dtype)
                if need_w:
                    grad_weight.addmm_(d.t(), h.float())
                if need_b:
                    grad_bias += d.sum(0)
        return (grad_hidden, grad_weight.to(weight.dtype) if need_w else None,
                grad_bias.to(bias.dtype) if need_b else None, None, None, None, None)


# Config attributes of models whose forward transforms the logits after the LM head (softcapping, scaling):
# for those the head's output is needed as it is, so the fused path is not taken.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


@dataclass
class _HeadRead:
    """What the LM head's hooks do for one forward: keep the hidden states at `source`; `fused`: also compute
    the log-probs of `targets` in place of the logits (`[1, K, 2]`: log-prob, entropy)."""

    head: torch.nn.Module
    source: torch.Tensor
    targets: torch.Tensor
    temperature: float
    with_entropy: bool
    fused: bool
    hidden: torch.Tensor | None = None


# the forward running in this thread/task, read by the head's hooks
_head_read: contextvars.ContextVar[_HeadRead | None] = contextvars.ContextVar("posttrain_head_read", default=None)
_hook_lock = threading.Lock()


def _current(module: torch.nn.Module) -> _HeadRead | None:
    read = _head_read.get()
    return read if read is not None and read.head is module else None  # another caller's forward: untouched


def _head_pre_hook(module: torch.nn.Module, args: tuple):
    """Only the hidden states at this forward's read positions go into the head (none when fused)."""
    read = _current(module)
    if read is None:
        return None
    hidden = args[0]
    kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, read.source)
    if not read.fused:
        return (kept[None], *args[1:])
    read.hidden = kept
    return (hidden[:, :0], *args[1:])


def _head_post_hook(module: torch.nn.Module, args: tuple, output):
    """Fused: the head's output is `[1, K, 2]`, the read tokens' log-probs and entropies."""
    read = _current(module)
    if read is None or not read.fused:
        return None
    chunk = max(1, chunked_softmax.CHUNK_ELEMENTS // module.weight.shape[0])
    logp, entropy = _FusedHeadLogprobs.apply(read.hidden, module.weight, module.bias, read.targets,
                                             float(read.temperature), chunk, read.with_entropy)
    read.hidden = None
    return torch.stack([logp, entropy if read.with_entropy else torch.zeros_like(logp)], -1)[None]


def _fusable(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return type(head) is torch.nn.Linear and all(getattr(text, a, None) is None for a in _LOGIT_TRANSFORMS)


@contextlib.contextmanager
def _reading_head(model: torch.nn.Module, source: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool):
    """Inside the block, the LM head of `model` sees only the hidden states at the flat indices `source`.

    Yields `fused`: True when the head (a plain `nn.Linear` whose output the model leaves as it is) computes
    the log-probs itself (`_FusedHeadLogprobs`, output `[1, K, 2]`); False when it returns the read
    positions' logits (`[1, K, V]`); None when the model has no output embedding to hook (its logits,
    `[.., V]` at every position, are then gathered after the forward). The hooks are registered once per
    head and inert unless this thread's context names the head: threads sharing a model (simulated
    ranks, generation beside training) do not see each other's positions.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield None
        return
    with _hook_lock:
        if not getattr(head, "_posttrain_read_hooks", False):
            head.register_forward_pre_hook(_head_pre_hook)
            head.register_forward_hook(_head_post_hook)
            head._posttrain_read_hooks = True
    read = _HeadRead(head, source, targets, temperature, with_entropy, _fusable(model, head))
    token = _head_read.set(read)
    try:
        yield read.fused
    finally:
        _head_read.reset(token)


# ------------------------------------------------------------------------------- the primitive


def sequence_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float,
    return_entropy: bool = False,
    loss_mask: torch.Tensor | None = None,
):
    """Log-prob of every read token given its prefix. `[B, T]` ids -> `[B, T]` float32, 0 where not read.

    Read: the positions of `loss_mask` when given (what the objectives pass), else every real token
    after the first of its row. With `return_entropy=True` also returns the entropy of the predicting
    distribution at the same positions (`[B, T]`, 0 elsewhere, no gradient).
    """
    layout = _layout.get() or default_layout(model)
    read = read_positions(attention_mask, loss_mask)
    if layout == "padded":
        return _padded_token_logprobs(model, input_ids, attention_mask, read, temperature, return_entropy)
    u = unpad(input_ids, attention_mask, read, layout)
    with (_reading_head(model, u.source, u.targets, temperature, return_entropy) as fused,
          routing.forward_routes(model, tuple(input_ids.shape), u.real, u.flat, u.input_ids.numel())):
        out = model(input_ids=u.input_ids, position_ids=u.position_ids, use_cache=False)
    if fused:
        lp, ent = out.logits[0].unbind(-1)
        ent = ent.detach()
    else:
        logits = out.logits.reshape(-1, out.logits.shape[-1])
        if fused is None:
            logits = logits.index_select(0, u.source)
        lp, ent = token_logprobs_and_entropy(logits, u.targets, temperature, with_entropy=return_entropy)
    full = lp.new_zeros(input_ids.shape).index_put((u.rows, u.cols), lp)
    if not return_entropy:
        return full
    return full, lp.new_zeros(input_ids.shape).index_put((u.rows, u.cols), ent)


def _padded_token_logprobs(model, input_ids, attention_mask, read, temperature, return_entropy):
    """The rollout layout as it is: `[B, T, V]` logits and a float32 log-softmax over every position (reference)."""
    rows, cols = attention_mask.bool().nonzero(as_tuple=True)
    with routing.forward_routes(model, tuple(input_ids.shape), (rows, cols), rows * input_ids.shape[1] + cols,
                                input_ids.numel()):
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    logits = out.logits[:, :-1]
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    zeros = lp.new_zeros(lp.shape[0], 1)
    lp = torch.cat([zeros, lp], dim=1) * read
    if not return_entropy:
        return lp
    with torch.no_grad():
        rows = []
        for row in logits.split(1):  # one row at a time: [T, V] temporaries
            logp = torch.log_softmax(row.float() / temperature, dim=-1)
            rows.append(-(logp.exp() * logp).sum(-1))
        ent = torch.cat([zeros, torch.cat(rows)], dim=1) * read
    return lp, ent
