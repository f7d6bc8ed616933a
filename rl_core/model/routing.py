"""Mixture-of-experts routes: record the experts a forward chose, and replay recorded ones (routing replay).

A route is, for one token and one MoE layer, the `top_k` experts its router chose (in the router's order).
Routes travel as `[B, T, L, k]` uint8 in the rollout layout (`Trajectory.routes`, `Completions.routes`):
`NOT_ROUTED` (255) where nothing was recorded (padding, the last sampled token, which no forward fed).

Both directions are forward hooks on the routers of the supported families (`ROUTERS`: transformers'
`*TopKRouter` modules, which return `(logits, scores, indices)`), inert unless this thread's context names the
model (`forward_routes`): a reference or teacher model of the same architecture is never touched.

- **Record** (`capture`): each router's chosen indices, `[tokens, k]` per layer, in the model's layout.
- **Replay**: a token with a recorded route goes to those experts, weighted by the router's own gates for them
  (softmax of this forward's logits, gathered at the recorded experts, normalised as the router normalises):
  the router still gets its gradient. A token whose recorded route is `NOT_ROUTED` keeps its own choice.
  Replaying the route a router would choose anyway gives its output bit for bit.

`forward_routes(model, routes, index)` is what `rl_core.primitives.logprobs` calls around the forward: it moves
the rollout-layout routes of the binding the trainer set (`replaying`, `recording`) into the model's unpadded
layout and back.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

ROUTE_DTYPE = torch.uint8
NOT_ROUTED = 255  # no recorded route: the router's own choice stands
# what the vLLM engine and the machine check say of model.routing_replay=rollout on vLLM's CPU build
VLLM_CPU_HAS_NO_ROUTES = ("model.routing_replay=rollout with vLLM's CPU build: vLLM returns routed experts only from "
                          "its V2 model runner, which needs Triton (GPU builds); use rollout.backend=hf, or "
                          "model.routing_replay=old")


@dataclass(frozen=True)
class RouterSpec:
    """How a router family turns its logits into gates: `softmax(logits)` gathered at the chosen experts,
    divided by their sum when `normalize` (True, or the name of the router's flag), cast back to the logits'
    dtype when `cast`."""

    normalize: bool | str
    cast: bool


ROUTERS = {
    "MixtralTopKRouter": RouterSpec(normalize=True, cast=False),
    "Qwen2MoeTopKRouter": RouterSpec(normalize="norm_topk_prob", cast=True),
    "Qwen3MoeTopKRouter": RouterSpec(normalize="norm_topk_prob", cast=True),
    "OlmoeTopKRouter": RouterSpec(normalize="norm_topk_prob", cast=True),
}


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers of a supported family, in layer order (module order)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def router_gates(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The gates `router` gives the experts `indices [tokens, k]` from its `logits [tokens, E]` (its own formula)."""
    spec = ROUTERS[type(router).__name__]
    top = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    normalize = spec.normalize if isinstance(spec.normalize, bool) else bool(getattr(router, spec.normalize))
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype) if spec.cast else top


@dataclass
class _Forward:
    """One forward's routing, read by the router hooks: `layers` maps the model's routers to their layer;
    `replay [tokens, L, k]` long (NOT_ROUTED: own choice); `chosen[l]` what layer l's router ended up using."""

    layers: dict
    replay: torch.Tensor | None = None
    chosen: list = field(default_factory=list)
    differ: list = field(default_factory=list)  # per layer: tokens whose replayed route differs from the router's


_forward: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("posttrain_routing_forward", default=None)
_install_lock = threading.Lock()


def _router_hook(module: torch.nn.Module, args: tuple, output):
    fwd = _forward.get()
    layer = None if fwd is None else fwd.layers.get(module)
    if layer is None:
        return None  # another model's router, or no routing asked in this thread
    logits, scores, indices = output
    if fwd.replay is not None:
        want = fwd.replay[:, layer].to(device=indices.device, dtype=indices.dtype)
        own = (want == NOT_ROUTED).any(-1, keepdim=True)
        replayed = torch.where(own, indices, want)
        fwd.differ[layer] = (replayed.sort(-1).values != indices.sort(-1).values).any(-1) & ~own.squeeze(-1)
        indices, scores = replayed, router_gates(module, logits, replayed)
    fwd.chosen[layer] = indices.detach()
    return logits, scores, indices


def install(model: torch.nn.Module) -> dict:
    """Register the hooks on `model`'s routers (once) and return `{router: layer}` (kept on the model: a decoding
    loop asks once per token)."""
    layers = model.__dict__.get("_posttrain_router_layers")
    if layers is not None:
        return layers
    found = routers(model)
    with _install_lock:
        for r in found:
            if not getattr(r, "_posttrain_route_hook", False):
                r.register_forward_hook(_router_hook)
                r._posttrain_route_hook = True
    layers = {r: i for i, r in enumerate(found)}
    model.__dict__["_posttrain_router_layers"] = layers
    return layers


@contextlib.contextmanager
def capture(model: torch.nn.Module, replay: torch.Tensor | None = None) -> Iterator[_Forward]:
    """Around one forward of `model`: replay `replay [tokens, L, k]` (model layout; None: the routers choose), and
    after the block `fwd.chosen[l]` holds layer l's routes `[tokens, k]`, `fwd.differ[l]` (with a replay) the
    tokens whose recorded route differed from the router's own."""
    layers = install(model)
    with _setting(_forward, _Forward(layers, replay, [None] * len(layers), [None] * len(layers))) as fwd:
        yield fwd


def stacked(fwd: _Forward) -> torch.Tensor:
    """What a captured forward chose, `[tokens, L, k]`, as `ROUTE_DTYPE`."""
    if not fwd.chosen:
        raise RuntimeError("the model has no mixture-of-experts router of a supported family: no routes to record")
    if any(c is None for c in fwd.chosen):
        raise RuntimeError("a router of the model did not run in this forward: its routes cannot be recorded")
    return torch.stack(fwd.chosen, 1).to(ROUTE_DTYPE)


# ------------------------------------------------------------------- the trainer's binding, in the rollout layout


@dataclass
class _Binding:
    model: torch.nn.Module
    routes: torch.Tensor | None  # [B, T, L, k] to replay
    recorded: torch.Tensor | None = None  # [B, T, L, k] what the forward chose (recording)
    record: bool = False
    differ: int | torch.Tensor = 0  # (token, layer) pairs whose replayed route differs from what the router chose
    pairs: int | torch.Tensor = 0  # (token, layer) pairs replayed


_binding: contextvars.ContextVar[_Binding | None] = contextvars.ContextVar("posttrain_routing_binding", default=None)


def replaying(model: torch.nn.Module, routes: torch.Tensor) -> contextlib.AbstractContextManager[_Binding]:
    """Forwards of `model` in the block (through `rl_core.primitives.logprobs`) use `routes [B, T, L, k]`, the
    rollout layout of the batch they score."""
    return _bound(_Binding(model, routes))


def recording(model: torch.nn.Module) -> contextlib.AbstractContextManager[_Binding]:
    """Forwards of `model` in the block record their routes: `binding.recorded [B, T, L, k]` after it."""
    return _bound(_Binding(model, None, record=True))


def _bound(bind: _Binding) -> contextlib.AbstractContextManager[_Binding]:
    return _setting(_binding, bind)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    """`var` is `value` inside the block (this thread or task), as it was after it; yields `value`."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


@contextlib.contextmanager
def forward_routes(model: torch.nn.Module, shape: tuple[int, int], real: tuple[torch.Tensor, torch.Tensor],
                   flat: torch.Tensor, tokens: int) -> Iterator[None]:
    """Around the forward of a `[B, T]` batch (`shape`) laid out for the model: `real = (rows, cols)` of its real
    tokens, `flat` their index among the `tokens` the model sees. Replays or records this thread's binding for
    `model`; nothing when there is none."""
    bind = _binding.get()
    if bind is None or bind.model is not model:
        yield
        return
    replay = None
    if bind.routes is not None:
        r = bind.routes
        replay = torch.full((tokens, *r.shape[2:]), NOT_ROUTED, dtype=torch.long, device=flat.device)
        replay[flat] = r[real[0].to(r.device), real[1].to(r.device)].to(device=flat.device, dtype=torch.long)
    with capture(model, replay) as fwd:
        yield
    if replay is not None and fwd.layers:  # the (token, layer) pairs replayed, and those the router would have sent
        # elsewhere: device tensors, read once a step (RoutingReplay.metrics), not a host copy per forward
        bind.differ = bind.differ + torch.stack(fwd.differ, 1)[flat].sum()
        bind.pairs = bind.pairs + (replay[flat] != NOT_ROUTED).all(-1).sum()
    if bind.record:
        chosen = stacked(fwd)
        out = torch.full((*shape, *chosen.shape[1:]), NOT_ROUTED, dtype=ROUTE_DTYPE)
        out[real[0].cpu(), real[1].cpu()] = chosen[flat].cpu()
        bind.recorded = out


def checkpoint_context():
    """`torch.utils.checkpoint`'s `context_fn` (gradient checkpointing): the recomputation of a layer in backward runs
    under the routing of the forward it recomputes, read here as that forward runs (backward runs outside the
    caller's context, where a router would choose anew)."""
    return contextlib.nullcontext(), _setting(_forward, _forward.get())
