"""The accumulating trainer (SPEC.md §4): micro-batches, data-parallel sums, one normalisation per step.

One `train_step(batch, micro_batch_size, mini_batch_size=None)` trains on one collected batch:

1. π_old: for a ratio objective (`objective.old_logp_cache`), with `n_mini > 1` mini-batches or
   `certified_deterministic_forward`, an ahead pass computes π_old for the whole batch once, without
   grad, before the first update (same micro-batch layout as training); with `n_mini = 1` π_old is
   sg[ℓ] of the training forward. The cache is invalidated when the batch is done.
2. For each mini-batch (one optimizer step): for each micro-batch (chunk), `loss, metrics =
   objective.fn(model, chunk)`; backpropagate the chunk numerator (`loss × weight` for TOKEN_SUM,
   `loss` for MEAN with weight 1 per chunk) and add the weight up.
3. At the optimizer boundary: sum gradients, weights and metric sums across data-parallel ranks
   (the `dp_reducer` hook), divide gradients once by the global weight, clip (reporting the norm
   before clipping), AdamW step, scheduler step.

Splitting a step into any number of micro-batches or ranks therefore gives the unsplit loss and
gradient (up to float rounding), and a chunk of weight 0 changes nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from rl_core.primitives.objective import (
    OBJECTIVE_WEIGHT_SUM,
    Objective,
    Reduction,
    metric_aggregation,
)
from rl_core.trajectory import Trajectory


class DataParallelReducer(Protocol):
    """The data-parallel hook (`dp_reducer`): collectives over every rank of the policy's DP group.

    `all_reduce_(tensors)`: sum each tensor in place across ranks (required).
    `all_reduce_max_(tensors)`: elementwise max in place across ranks (optional; without it the
    `*_min` / `*_max` diagnostics stay rank-local).
    Every rank calls them the same number of times, in the same order, with tensors of the same
    shapes and dtypes: the trainer guarantees this when every rank runs the same objective and the
    same number of optimizer steps (the same `mini_batch_size` split), whatever its number of rows.
    """

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None: ...


class ProcessGroupReducer:
    """`DataParallelReducer` over an initialised `torch.distributed` process group (gloo / NCCL)."""

    def __init__(self, group=None):
        self.group = group

    def _reduce(self, tensors: list[torch.Tensor], op) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupReducer needs an initialised torch.distributed process group")
        for t in tensors:
            dist.all_reduce(t, op=op, group=self.group)

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        self._reduce(tensors, dist.ReduceOp.SUM)

    def all_reduce_max_(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        self._reduce(tensors, dist.ReduceOp.MAX)


class WarmupConstant:
    """LR factor: linear warmup over `warmup_steps` optimizer steps ((s + 1) / W), then 1.

    The first update uses lr / W and update W (1-based) the full lr; `warmup_steps = 0` is constant.
    A class (not a lambda) so that the scheduler state is picklable.
    """

    def __init__(self, warmup_steps: int):
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # plain types only, so that torch.load(weights_only=True) accepts the checkpoint
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value):
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


class LLMTrainer:
    """Gradient accumulation, data-parallel reduction, clipping, AdamW and exact checkpoint state.

    Args:
      model: the policy (`torch.nn.Module`, a causal LM); trained in place.
      objective: an `Objective` (SPEC §4).
      optimizer_config: `OptimizerConfig` (lr, betas, weight_decay, warmup_steps, max_grad_norm).
      auxiliary_models: frozen networks the objective's scorers need, e.g. `{"reference": model}`
        for a KL anchor (`objective.reference_scorer`); never read off the objective.
      dp_reducer: the data-parallel hook (`DataParallelReducer`); None for a single replica.
      metric_split: prefix of the published metric names ("train").
    """

    REFERENCE = "reference"

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        optimizer_config,
        auxiliary_models: Mapping[str, torch.nn.Module] | None = None,
        *,
        dp_reducer: DataParallelReducer | None = None,
        metric_split: str = "train",
    ):
        if not isinstance(objective, Objective):
            raise TypeError(f"objective must be an Objective, got {type(objective).__name__}")
        self.model = model
        self.objective = objective
        self.optimizer_config = optimizer_config
        self.auxiliary_models = dict(auxiliary_models or {})
        if dp_reducer is not None and not callable(getattr(dp_reducer, "all_reduce_", None)):
            raise TypeError("dp_reducer must have all_reduce_(tensors) (sum in place across ranks)")
        self.dp_reducer = dp_reducer
        self.metric_split = metric_split
        if objective.reference_scorer is not None and self.REFERENCE not in self.auxiliary_models:
            raise ValueError("the objective has a reference_scorer (rl.kl_beta > 0) but no reference model was "
                             "given: pass auxiliary_models={'reference': frozen_model}")
        for aux in self.auxiliary_models.values():
            aux.requires_grad_(False)
            aux.eval()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=optimizer_config.lr,
            betas=tuple(optimizer_config.betas),
            weight_decay=optimizer_config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupConstant(optimizer_config.warmup_steps))
        self.step = 0  # optimizer steps taken
        self.policy_version = 0  # collected batches trained (one weight sync each)

    # ------------------------------------------------------------------------------------------ api

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def train_step(self, batch: Trajectory, micro_batch_size: int | None = None,
                   mini_batch_size: int | None = None) -> dict[str, float]:
        """Train on one collected batch; returns public metrics (`train/...`), averaged over its optimizer steps.

        `mini_batch_size`: rows per optimizer step (`rl.mini_batch_per_replica`); None = the whole
        batch, one step. `micro_batch_size`: rows per forward/backward chunk
        (`rl.micro_batch_per_replica`); None = the whole mini-batch.
        """
        if not isinstance(batch, Trajectory):
            raise TypeError(f"batch must be a Trajectory, got {type(batch).__name__}")
        if batch.batch_size == 0:
            raise ValueError("train_step got an empty batch")
        minis = batch.split(mini_batch_size) if mini_batch_size else [batch]
        micro_batch_size = micro_batch_size or max(len(m) for m in minis)
        cache = self.objective.old_logp_cache
        if cache is None and len(minis) > 1:
            raise ValueError(f"mini_batch_size={mini_batch_size} gives {len(minis)} updates per batch, but the objective "
                             "has no pi_old (on-policy only, e.g. rl.grpo_surrogate=legacy_pg); use one update per batch")
        self.model.train()
        if cache is not None:
            if len(minis) > 1 or cache.certified_deterministic_forward:
                cache.fill(batch.sample_ids, self._ahead_pass(cache, minis, micro_batch_size), batch.policy_version)
            else:
                cache.fill_on_policy(batch.sample_ids, batch.policy_version)
        results = []
        try:
            for k, mini in enumerate(minis):
                if cache is not None:
                    cache.certify = cache.certified_deterministic_forward and k == 0
                results.append(self._optimizer_step(mini, micro_batch_size))
                if cache is not None:
                    cache.certify = False
        finally:
            if cache is not None:
                cache.invalidate()
        self.policy_version += 1
        return _combine_steps(results)

    def state_dict(self) -> dict:
        """Everything an exact resume needs: model, optimizer, scheduler, RNG states, counters."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            "counters": {"step": self.step, "policy_version": self.policy_version},
            "objective_identity": dict(self.objective.identity),
        }

    def load_state_dict(self, state: Mapping) -> None:
        missing = [k for k in ("model", "optimizer", "scheduler", "rng", "counters") if k not in state]
        if missing:
            raise KeyError(f"trainer checkpoint lacks {missing}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        self.step = int(state["counters"]["step"])
        self.policy_version = int(state["counters"]["policy_version"])

    # ------------------------------------------------------------------------------------ internals

    def _ahead_pass(self, cache, minis: list[Trajectory], micro_batch_size: int) -> torch.Tensor:
        """π_old `[N, T]` for the whole batch, no grad, in the training micro-batch layout."""
        out = []
        for mini in minis:
            for chunk in mini.split(micro_batch_size):
                out.append(cache.scorer(self.model, chunk.to(self.device)))
        return torch.cat(out, 0)

    def _optimizer_step(self, mini: Trajectory, micro_batch_size: int) -> dict[str, float]:
        objective = self.objective
        token_sum = objective.reduction is Reduction.TOKEN_SUM
        chunks = mini.split(micro_batch_size)
        if not token_sum and len({len(c) for c in chunks}) > 1:
            raise ValueError(f"Reduction.MEAN divides by the number of chunks, so chunks must be equal: "
                             f"micro_batch_size={micro_batch_size} does not divide the mini-batch of {len(mini)} rows")
        for p in self.params:
            p.grad = None
        weight_sum = 0.0
        loss_sum = 0.0
        sums: dict[str, float] = {}
        extrema: dict[str, float] = {}  # max of value (for *_max) or of -value (for *_min)
        names: list[str] | None = None
        for chunk in chunks:
            chunk = chunk.to(self.device)
            if objective.reference_scorer is not None and chunk.ref_logp is None:
                chunk = chunk.replace(ref_logp=objective.reference_scorer(self.auxiliary_models[self.REFERENCE], chunk))
            loss, metrics = objective.fn(self.model, chunk)
            objective.metric_adapter.publish(metrics, self.metric_split)  # unmapped names fail here, on step 1
            if token_sum:
                if OBJECTIVE_WEIGHT_SUM not in metrics:
                    raise KeyError(f"a Reduction.TOKEN_SUM objective must report its chunk weight as "
                                   f"metrics[{OBJECTIVE_WEIGHT_SUM!r}]")
                weight = float(metrics[OBJECTIVE_WEIGHT_SUM])
            else:
                weight = 1.0
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"objective weight {weight} is not a finite non-negative number")
            chunk_names = sorted(k for k in metrics if k != OBJECTIVE_WEIGHT_SUM)
            if names is None:
                names = chunk_names
                for k in names:
                    agg = metric_aggregation(k)
                    if agg == "mean":
                        sums[k] = 0.0
                    else:
                        extrema[k] = -math.inf
            elif chunk_names != names:
                raise ValueError(f"the objective emitted different metric names across chunks: {names} vs {chunk_names}")
            if weight == 0:
                continue  # a weight-0 chunk changes nothing (no gradient, no metric)
            (loss * weight if token_sum else loss).backward()
            weight_sum += weight
            loss_sum += float(loss.detach()) * weight
            for k in names:
                v = float(metrics[k])
                agg = metric_aggregation(k)
                if agg == "mean":
                    sums[k] += v * weight
                else:
                    extrema[k] = max(extrema[k], v if agg == "max" else -v)

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        mean_keys = sorted(sums)
        ext_keys = sorted(extrema)
        # on the model's device: NCCL reduces CUDA tensors only
        stats = torch.tensor([weight_sum, loss_sum] + [sums[k] for k in mean_keys], dtype=torch.float64,
                             device=self.device)
        ext = torch.tensor([extrema[k] for k in ext_keys], dtype=torch.float64, device=self.device)
        if self.dp_reducer is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dp_reducer.all_reduce_([flat, stats])
            reduce_max = getattr(self.dp_reducer, "all_reduce_max_", None)
            if ext.numel() and reduce_max is not None:
                reduce_max([ext])
            grads = list(torch.split(flat, [g.numel() for g in grads]))
            grads = [g.view_as(p) for g, p in zip(grads, self.params)]
        total_weight = float(stats[0])
        if total_weight <= 0:
            raise ValueError("the global objective weight of this optimizer step is 0 (no loss tokens on any "
                             "micro-batch or rank); the batch should have been refused before dispatch")
        for p, g in zip(self.params, grads):
            p.grad = g.div_(total_weight)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.optimizer_config.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

        local: dict[str, float] = {k: float(v) / total_weight for k, v in zip(mean_keys, stats[2:].tolist())}
        for k, v in zip(ext_keys, ext.tolist()):
            local[k] = v if metric_aggregation(k) == "max" else -v
        out = objective.metric_adapter.publish(local, self.metric_split)
        out[f"{self.metric_split}/loss"] = float(stats[1]) / total_weight
        out[f"{self.metric_split}/grad_norm"] = float(grad_norm)
        out[f"{self.metric_split}/lr"] = float(lr)
        return out


def _combine_steps(results: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimizer steps on one batch: min/max for *_min/*_max, mean otherwise."""
    if len(results) == 1:
        return dict(results[0])
    out: dict[str, float] = {}
    for k in results[0]:
        values = [r[k] for r in results]
        agg = metric_aggregation(k)
        out[k] = min(values) if agg == "min" else max(values) if agg == "max" else sum(values) / len(values)
    return out
