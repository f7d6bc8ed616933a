"""The model capability protocol: what a policy model declares it can do, read by preflight, the engines and the
trainer; never by an objective (docs/moe.md).

- **Routing replay** (`model.routing_replay`): a mixture-of-experts model whose routers are of a supported family
  (`rl_core.model.routing.ROUTERS`) can record the experts each token was sent to and replay recorded ones.
  `rollout`: the engine records the routes of every sampled token (`Completions.routes`, then `Trajectory.routes`)
  and the trainer's forwards (π_old and π_θ) replay them; `old`: the trainer's own π_old pass records them and the
  training forwards of that batch replay them. The routes are per-token model inputs: they travel in the batch
  through annotate, the gate, data-parallel dispatch and micro-batching, and the trainer binds them around the
  forward (`RoutingReplay`), with the objective given the batch without them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rl_core.model import routing

ROUTING_REPLAY_MODES = ("off", "rollout", "old")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's routing: `layers` routers, each picking `top_k` of `experts`."""

    layers: int
    experts: int
    top_k: int


@dataclass(frozen=True)
class ModelCapabilities:
    """`experts`: the routing this project can record and replay (None: a dense model, or experts whose router
    family is not supported, named by `unsupported_router`)."""

    experts: Experts | None = None
    unsupported_router: str | None = None

    @property
    def routing_replay(self) -> bool:
        return self.experts is not None

    def why_no_replay(self) -> str | None:
        """Why this model has no routes to replay (None: it has)."""
        if self.routing_replay:
            return None
        if self.unsupported_router:
            return (f"its routers ({self.unsupported_router}) are not of a family it can replay "
                    f"({', '.join(routing.ROUTERS)}; docs/moe.md)")
        return "it is a dense model, with no mixture-of-experts router"


def capabilities(model: torch.nn.Module) -> ModelCapabilities:
    """What `model` (a transformers causal LM, possibly wrapped by PEFT or FSDP) can do."""
    found = routing.routers(model)
    if found:
        if len({(r.num_experts, r.top_k) for r in found}) > 1:
            return ModelCapabilities(unsupported_router="routers of different sizes")
        return ModelCapabilities(Experts(len(found), int(found[0].num_experts), int(found[0].top_k)))
    named = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")})
    return ModelCapabilities(unsupported_router=", ".join(named) or None)


class RoutingReplay:
    """The trainer's side of `model.routing_replay` for one model: the contexts its π_old pass (`scoring`) and its
    training forwards (`training`) run in, and the routes the π_old pass recorded (mode `old`, until `clear`)."""

    def __init__(self, model: torch.nn.Module, mode: str = "off"):
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"model.routing_replay={mode!r}; expected one of {ROUTING_REPLAY_MODES}")
        why = capabilities(model).why_no_replay()
        if mode != "off" and why:
            raise ValueError(f"model.routing_replay={mode}: the policy cannot replay routes, {why}; "
                             "set model.routing_replay=off")
        self.model, self.mode = model, mode
        self._old: dict[int, torch.Tensor] = {}  # sample id -> [T, L, k]: the π_old pass's routes (mode old)
        self._differ = self._pairs = 0  # this batch's replayed (token, layer) pairs, and those routed elsewhere

    @contextlib.contextmanager
    def scoring(self, chunk) -> Iterator[None]:
        """Around the π_old pass of `chunk`: `rollout` replays its routes, `old` records them."""
        if self.mode != "old":
            with self.training(chunk):
                yield
            return
        with routing.recording(self.model) as bind:
            yield
        for sid, row in zip(chunk.sample_ids.tolist(), bind.recorded):
            self._old[sid] = row

    @contextlib.contextmanager
    def training(self, chunk) -> Iterator[None]:
        """Around a forward that trains on `chunk`: the routes it replays (none when off, or `old` without a π_old
        pass, where the training forward is π_old's own)."""
        routes = None
        if self.mode == "rollout":
            if chunk.routes is None:
                raise ValueError("model.routing_replay=rollout: the batch carries no routes; the rollout engine must "
                                 "record them (rollout.backend=hf or vllm with a supported MoE model)")
            routes = chunk.routes
        elif self.mode == "old" and self._old:
            routes = torch.stack([self._old[s] for s in chunk.sample_ids.tolist()])
        if routes is None:
            yield
            return
        with routing.replaying(self.model, routes) as bind:
            yield
        self._differ, self._pairs = self._differ + bind.differ, self._pairs + bind.pairs

    def metrics(self, split: str) -> dict[str, float]:
        """`<split>/routing_replay_differ_frac`: of the (token, layer) pairs this batch's forwards replayed on this
        rank, the share its routers would have sent to other experts (0 when replay changed nothing)."""
        pairs = int(self._pairs)
        return {f"{split}/routing_replay_differ_frac": int(self._differ) / pairs} if pairs else {}

    def clear(self) -> None:
        self._old.clear()
        self._differ = self._pairs = 0


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (transformers' non-reentrant checkpointing), each recomputation under
    the routing of the forward it redoes (`routing.checkpoint_context`: replayed routes stay replayed)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": routing.checkpoint_context})
