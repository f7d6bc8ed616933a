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
- **Log-probs only where read.** A forward pre-hook on the LM head keeps only the hidden states whose
  next token is read (the loss mask; every real token by default), so the logits are `[K, V]` for K
  read tokens, never `[B, T, V]`, and the float32 log-softmax and entropy run over chunks of them
  (`token_logprobs_and_entropy`), with a backward that recomputes each chunk's softmax.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass

import torch

FORWARD_LAYOUTS = ("rows", "packed", "padded")
# float32 elements of one chunk of the log-softmax: with a 151,936-token vocabulary, 110 positions (64 MiB)
CHUNK_ELEMENTS = 16 * 1024 * 1024

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


# ------------------------------------------------------------------------- chunked log-softmax


class _TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits / T)[target]` and the entropy of `softmax(logits / T)`, `[K, V]` -> `[K]`, `[K]` float32.

    Forward and backward walk the rows in chunks of `chunk` rows, so the float32 temporaries are
    `[chunk, V]`; autograd keeps only the logits (already alive) and the `[K]` log-normalisers.
    The entropy is a diagnostic: it carries no gradient.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy):
        k = logits.shape[0]
        logp = torch.empty(k, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
        for s in range(0, k, chunk):
            x = logits[s:s + chunk].float() / temperature  # a new tensor: float() of float32 is the same one
            lse[s:s + chunk] = torch.logsumexp(x, dim=-1)
            logp[s:s + chunk] = x.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            if with_entropy:  # H = lse - Σ p x
                x_p = torch.softmax(x, dim=-1).mul_(x)
                entropy[s:s + chunk] = lse[s:s + chunk] - x_p.sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            g = grad_logp[s:s + chunk, None].float()
            x = logits[s:s + chunk].float() / t
            p = x.sub_(lse[s:s + chunk, None]).exp_()  # softmax, in place of x
            d = p.mul_(-g)
            d.scatter_add_(-1, targets[s:s + chunk, None], g)
            grad[s:s + chunk] = d.div_(t)
        return grad, None, None, None, None


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, *,
                               with_entropy: bool = False, chunk: int | None = None):
    """Chunked float32 `log_softmax(logits / T)[targets]` (and entropy). logits `[K, V]`, targets `[K]` -> `[K]`, `[K]`."""
    if chunk is None:
        chunk = max(1, CHUNK_ELEMENTS // max(int(logits.shape[-1]), 1))
    return _TokenLogprobs.apply(logits, targets, float(temperature), int(chunk), bool(with_entropy))


# ------------------------------------------------------------------------------------ layouts


@dataclass
class UnpaddedBatch:
    """The real tokens of a `[B, T]` batch in an unpadded layout, and where to find the read positions.

    `input_ids`/`position_ids`: what the model sees (`[B, L]` for rows, `[1, N]` for packed).
    `rows`, `cols`: the read positions t of the original batch (`[K]` each); `source`: the flat index,
    in the model's layout, of the token before each of them (whose logits predict it); `targets`:
    the token ids read (`[K]`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    rows: torch.Tensor
    cols: torch.Tensor
    source: torch.Tensor
    targets: torch.Tensor


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
        return UnpaddedBatch(ids, positions, b_read, t_read, source, input_ids[b_read, t_read])
    if layout != "packed":
        raise ValueError(f"unpad layout {layout!r}; expected 'rows' or 'packed'")
    offset = lengths.cumsum(0) - lengths
    ids = input_ids[b_real, t_real][None]
    positions = col[b_real, t_real][None]
    source = offset[b_read] + col[b_read, t_read] - 1
    return UnpaddedBatch(ids, positions, b_read, t_read, source, input_ids[b_read, t_read])


# (LM head, flat indices) of the forward running in this thread/task, read by the head's pre-hook
_read_source: contextvars.ContextVar[tuple[torch.nn.Module, torch.Tensor] | None] = contextvars.ContextVar(
    "posttrain_read_source", default=None)
_hook_lock = threading.Lock()


def _keep_read_positions(module: torch.nn.Module, args: tuple):
    """The LM head's forward pre-hook: only the hidden states at this forward's read positions go in."""
    current = _read_source.get()
    if current is None or current[0] is not module:
        return None  # another caller's forward (generation, a user's own call): untouched
    hidden = args[0]
    return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, current[1])[None], *args[1:])


@contextlib.contextmanager
def _hidden_states_at(model: torch.nn.Module, source: torch.Tensor):
    """Inside the block, the LM head of `model` sees only the hidden states at the flat indices `source`.

    One forward pre-hook per head, registered once and inert unless this thread's context names the
    head (threads sharing a model, e.g. simulated ranks or generation beside training, do not see each
    other's positions): the logits come out `[1, K, V]`. Yields False when the model has no output
    embedding to hook (its logits are then gathered after the forward).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield False
        return
    with _hook_lock:
        if not getattr(head, "_posttrain_read_hook", False):
            head.register_forward_pre_hook(_keep_read_positions)
            head._posttrain_read_hook = True
    token = _read_source.set((head, source))
    try:
        yield True
    finally:
        _read_source.reset(token)


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
    with _hidden_states_at(model, u.source) as hooked:
        out = model(input_ids=u.input_ids, position_ids=u.position_ids, use_cache=False)
    logits = out.logits
    logits = logits.reshape(-1, logits.shape[-1])
    if not hooked:
        logits = logits.index_select(0, u.source)
    lp, ent = token_logprobs_and_entropy(logits, u.targets, temperature, with_entropy=return_entropy)
    full = lp.new_zeros(input_ids.shape).index_put((u.rows, u.cols), lp)
    if not return_entropy:
        return full
    return full, lp.new_zeros(input_ids.shape).index_put((u.rows, u.cols), ent)


def _padded_token_logprobs(model, input_ids, attention_mask, read, temperature, return_entropy):
    """The rollout layout as it is: `[B, T, V]` logits and a float32 log-softmax over every position (reference)."""
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
