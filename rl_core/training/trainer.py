"""The accumulating trainer (docs/objectives.md): micro-batches, data-parallel sums, one normalisation per step.

One `train_step(batch, micro_batch_size, mini_batch_size=None)` trains on one collected batch:

1. π_old: for a ratio objective (`objective.old_logp_cache`), with `n_mini > 1` mini-batches or
   `certified_deterministic_forward`, an ahead pass computes π_old for the whole batch once, without
   grad, before the first update (same micro-batch layout as training); with `n_mini = 1` π_old is
   sg[ℓ] of the training forward. The cache is invalidated when the batch is done.
2. For each mini-batch (one optimizer step): for each micro-batch (chunk: `micro_batch_size` rows,
   or whole rows grouped by length under `micro_batch_max_tokens`), `loss, metrics =
   objective.fn(model, chunk)`; backpropagate the chunk numerator (`loss × weight` for TOKEN_SUM,
   `loss` for MEAN with weight 1 per chunk) and add the weight up. Loss, weights and metrics stay
   on the device as tensors.
3. At the optimizer boundary: sum gradients, weights and metric sums across data-parallel ranks
   (the `dp_reducer` hook), divide gradients once by the global weight, clip (reporting the norm
   before clipping), read loss, weights, metrics and the norm in one device-to-host copy (refusing
   a non-finite loss or weight before anything is applied), AdamW step, scheduler step.

Precision: parameters, gradients and AdamW state are whatever the model holds (float32 master
weights in posttrain); with `compute_dtype=torch.bfloat16` every forward (training, π_old, the
reference scorer) runs under `torch.autocast`, so matmuls run in bf16 while the update is applied
to float32 weights and gradients are reduced in float32.

Sharding: a model wrapped with torch FSDP2 (`fully_shard`) reduce-scatters its own gradients in
backward; the trainer sets FSDP's divide factor to 1 so that they arrive as the same cross-rank sum
of numerators, and reduces only the weights and metric sums itself. Every chunk runs its backward
(a weight-0 chunk backpropagates zero), and under a token budget a rank with fewer chunks adds
weight-0 padding chunks, since FSDP's collectives run in forward and backward on every rank. `state_dict()` holds full (gathered) tensors in either mode, keyed the same
way, so a checkpoint of one mode resumes in the other.

Splitting a step into any number of micro-batches or ranks therefore gives the unsplit loss and
gradient (up to float rounding), and a chunk of weight 0 changes nothing.

The checkpoint state (`state_dict`, `shard_state` and their loads) is `rl_core.training.state`; the data-parallel
hook, FSDP2 detection and the bucketed gradient all-reduce are `rl_core.training.data_parallel`; how a
mini-batch is cut into chunks is `rl_core.training.micro_batches`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch

from rl_core.batch.trajectory import Trajectory
from rl_core.model.protocol import RoutingReplay
from rl_core.primitives.objective import (
    OBJECTIVE_WEIGHT_SUM,
    SKIPPED_UPDATES,
    Objective,
    Reduction,
    combine_step_metrics,
    metric_aggregation,
)
from rl_core.training.data_parallel import DataParallelReducer, all_reduce_in_buckets, is_dtensor, is_sharded
from rl_core.training.micro_batches import plan_micro_batches
from rl_core.training.state import TrainerState, WarmupConstant


class SamplerGapError(RuntimeError):
    """The sampler-vs-trainer log-prob gap of a batch is above `max_rollout_logp_abs_diff`: the step was refused."""


class LLMTrainer(TrainerState):
    """Gradient accumulation, data-parallel reduction, clipping, AdamW and exact checkpoint state.

    Args:
      model: the policy (`torch.nn.Module`, a causal LM); trained in place.
      objective: an `Objective` (docs/objectives.md).
      optimizer_config: `OptimizerConfig` (lr, betas, weight_decay, warmup_steps, max_grad_norm).
      auxiliary_models: frozen networks the objective's scorers need, e.g. `{"reference": model}`
        for a KL anchor (`objective.reference_scorer`); never read off the objective.
      dp_reducer: the data-parallel hook (`DataParallelReducer`); None for a single replica.
      metric_split: prefix of the published metric names ("train").
      compute_dtype: torch.float32, or torch.bfloat16 for forward/backward under autocast (the
        parameters and optimizer state keep their own dtype).
      max_staleness: `rl.async_steps`. 0 (on-policy): every batch is taken as sampled by the current
        policy. k > 0: a batch may come from up to k policy versions back; π_old of a stale batch is
        its rollout log-probs (the behaviour policy), so the ratio corrects for the lag.
      skip_empty_updates: `rl.objective.mask_truncated`: an optimizer step without a loss token on any rank (every
        row masked) is skipped, weights and optimizer state unchanged (`train/skipped_updates`), not refused.
      routing_replay: `model.routing_replay` (`rl_core.model.protocol.RoutingReplay`): the experts of a
        mixture-of-experts policy's π_old and training forwards; the objective gets each chunk without its routes.
    """

    REFERENCE = "reference"
    GRAD_BUCKET_BYTES = 256 * 1024 * 1024  # unsharded gradient all-reduce: at most this much extra memory

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        optimizer_config,
        auxiliary_models: Mapping[str, torch.nn.Module] | None = None,
        *,
        dp_reducer: DataParallelReducer | None = None,
        metric_split: str = "train",
        compute_dtype: torch.dtype = torch.float32,
        max_staleness: int = 0,
        max_rollout_logp_abs_diff: float | None = None,
        skip_empty_updates: bool = False,
        routing_replay: str = "off",
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
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}")
        self.compute_dtype = compute_dtype
        if max_staleness and objective.old_logp_cache is None:
            raise ValueError(f"max_staleness={max_staleness}: this objective has no pi_old (on-policy only), so a "
                             "stale batch cannot be corrected; use max_staleness=0")
        self.max_staleness = int(max_staleness)
        self.max_rollout_logp_abs_diff = max_rollout_logp_abs_diff
        self.skip_empty_updates = skip_empty_updates
        self.routing = RoutingReplay(model, routing_replay)
        self.sharded = is_sharded(model)
        if self.sharded:
            if dp_reducer is None:
                raise ValueError("an FSDP-sharded model needs a dp_reducer for the weights and metrics")
            for module in model.modules():  # every FSDP unit reduce-scatters plain sums of numerators
                if is_sharded(module):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM: gloo has no PREMUL_SUM
        if objective.reference_scorer is not None and self.REFERENCE not in self.auxiliary_models:
            raise ValueError("the objective has a reference_scorer (rl.objective.kl_beta > 0) but no reference model was "
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

    def autocast(self):
        """The forward-pass context: bf16 autocast when `compute_dtype` is bf16, else nothing."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def release_gradients(self) -> None:
        """Drop the gradients of the last step (they are not needed until the next one): frees P floats."""
        for p in self.params:
            p.grad = None

    def exported_model_state(self) -> dict[str, torch.Tensor]:
        """Sharded: the whole float32 model in rank 0's host memory, for an export (every rank must call it; the
        others get an empty dict). Each tensor is gathered on the device and moved to rank 0's CPU before the next
        (torch.distributed.checkpoint's `full_state_dict` with `cpu_offload`), so no device holds the whole model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def iter_full_model_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, full tensor)` one at a time, in `state_dict` order, each gathered (sharded: every rank must
        iterate to the end, the gathers are collectives) in its own dtype: a consumer that drops each tensor holds
        one at a time, and one that packs it into a wire bucket (`infra.workers.distributed.WeightStream`) casts as it
        copies, with no cast copy beside the bucket."""
        for name, value in self.model.state_dict().items():
            yield name, (value.full_tensor() if is_dtensor(value) else value.detach())

    def train_step(self, batch: Trajectory, micro_batch_size: int | None = None,
                   mini_batch_size: int | None = None, micro_batch_max_tokens: int | None = None) -> dict[str, float]:
        """Train on one collected batch; returns public metrics (`train/...`), averaged over its optimizer steps.

        `mini_batch_size`: rows per optimizer step (`rl.mini_batch_per_replica`); None = the whole
        batch, one step. `micro_batch_size`: rows per forward/backward chunk
        (`rl.micro_batch_per_replica`). `micro_batch_max_tokens` (`rl.micro_batch_max_tokens`): chunks of
        whole rows grouped by length, each at most this many unpadded tokens (`Trajectory.token_budget_split`;
        `micro_batch_size` then caps their rows). Neither (TOKEN_SUM): the whole mini-batch, or its rows by length
        under `Trajectory.padding_budget` when its padding would cost more than its real tokens.
        """
        if not isinstance(batch, Trajectory):
            raise TypeError(f"batch must be a Trajectory, got {type(batch).__name__}")
        if batch.batch_size == 0:
            raise ValueError("train_step got an empty batch")
        minis = batch.split(mini_batch_size) if mini_batch_size else [batch]
        cache = self.objective.old_logp_cache
        if cache is None and len(minis) > 1 and not self.objective.multiple_updates:
            raise ValueError(f"mini_batch_size={mini_batch_size} gives {len(minis)} updates per batch, but the objective "
                             "has no pi_old (on-policy only, e.g. rl.objective.type=legacy_pg); use one update per batch")
        plans = [plan_micro_batches(mini, micro_batch_size, micro_batch_max_tokens, reduction=self.objective.reduction,
                                    reducer=self.dp_reducer if self.sharded else None, device=self.device)
                 for mini in minis]
        self.model.train()
        behaviour = self._stale(batch)
        if cache is not None:
            if behaviour:  # sampled by an older policy: the ratio is taken against what sampled it
                cache.fill(batch.sample_ids, batch.rollout_logp, batch.policy_version)
            elif len(minis) > 1 or cache.certified_deterministic_forward:
                cache.fill(*self._ahead_pass(cache, plans), batch.policy_version)
            else:
                cache.fill_on_policy(batch.sample_ids, batch.policy_version)
        results = []
        try:
            for k, chunks in enumerate(plans):
                certify = cache is not None and cache.certified_deterministic_forward and k == 0 and not behaviour
                results.append(self._optimizer_step(chunks, certify, check_gap=k == 0))
            replay = self.routing.metrics(self.metric_split)
        finally:
            self.routing.clear()
            if cache is not None:
                cache.invalidate()
        self.policy_version += 1
        return {**combine_step_metrics(results, self.metric_split), **replay}

    def skip_batch(self) -> None:
        """Count a collected batch as trained without training on it (PPO's critic warm-up): the weights, optimizer
        and schedule stay as they are, the policy version moves on as the engines' does."""
        self.policy_version += 1

    def _stale(self, batch: Trajectory) -> bool:
        """Whether `batch` was sampled by an older policy (only with `max_staleness` > 0); refuses one older than
        `max_staleness` versions or newer than the trainer."""
        if not self.max_staleness:
            return False
        lag = self.policy_version - int(batch.policy_version)
        if not 0 <= lag <= self.max_staleness:
            raise ValueError(f"batch of policy_version={batch.policy_version} for a trainer at policy_version="
                             f"{self.policy_version}: {lag} version(s) behind, outside 0..{self.max_staleness} "
                             "(rl.async_steps)")
        return lag > 0

    # ------------------------------------------------------------------------------------ internals

    def _ahead_pass(self, cache, plans: list[list[tuple[Trajectory, bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """π_old of the whole batch, no grad, in the training micro-batch layout: `(sample_ids [N], logp [N, T])`."""
        ids, out = [], []
        for chunks in plans:
            for chunk, padding in chunks:
                with self.autocast(), self.routing.scoring(chunk):
                    logp = cache.scorer(self.model, chunk.to(self.device).replace(routes=None))
                if not padding:
                    ids.append(chunk.sample_ids)
                    out.append(logp)
        return torch.cat(ids), torch.cat(out, 0)

    def _optimizer_step(self, chunks: list[tuple[Trajectory, bool]], certify: bool,
                        check_gap: bool = False) -> dict[str, float]:
        """One optimizer step over `chunks`. Loss, weights and metrics are summed on the device and read once,
        after the data-parallel reduction (a single device-to-host copy per step). `check_gap` (the batch's first
        step, whose weights are those the batch's rollout was synced to): refuse the step before it is applied when
        the sampler-vs-trainer log-prob gap is above `max_rollout_logp_abs_diff`."""
        objective = self.objective
        cache = objective.old_logp_cache
        token_sum = objective.reduction is Reduction.TOKEN_SUM
        for p in self.params:
            p.grad = None
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        weight_sum, loss_sum, bad = zero, zero, zero  # bad: chunks with a non-finite loss or a bad weight
        sums: dict[str, torch.Tensor] = {}
        extrema: dict[str, torch.Tensor] = {}  # max of value (for *_max) or of -value (for *_min)
        names: list[str] | None = None
        for chunk, padding in chunks:
            chunk = chunk.to(self.device)
            if objective.reference_scorer is not None and chunk.ref_logp is None:
                with torch.no_grad(), self.autocast():
                    ref = objective.reference_scorer(self.auxiliary_models[self.REFERENCE], chunk)
                chunk = chunk.replace(ref_logp=ref)
            if cache is not None:
                cache.certify = certify and not padding
            try:
                with self.autocast(), self.routing.training(chunk):
                    loss, metrics = objective.fn(self.model, chunk.replace(routes=None))
            finally:
                if cache is not None:
                    cache.certify = False
            objective.metric_adapter.publish(metrics, self.metric_split)  # unmapped names fail here, on step 1
            if token_sum:
                if OBJECTIVE_WEIGHT_SUM not in metrics:
                    raise KeyError(f"a Reduction.TOKEN_SUM objective must report its chunk weight as "
                                   f"metrics[{OBJECTIVE_WEIGHT_SUM!r}]")
                weight = _device_scalar(metrics[OBJECTIVE_WEIGHT_SUM], self.device)
            else:
                weight = torch.ones((), dtype=torch.float64, device=self.device)
            if padding:
                weight = weight * 0
            chunk_names = sorted(k for k in metrics if k != OBJECTIVE_WEIGHT_SUM)
            if names is None:
                names = chunk_names
                for k in names:
                    if metric_aggregation(k) == "mean":
                        sums[k] = zero
                    else:
                        extrema[k] = torch.full((), -math.inf, dtype=torch.float64, device=self.device)
            elif chunk_names != names:
                raise ValueError(f"the objective emitted different metric names across chunks: {names} vs {chunk_names}")
            live = weight > 0
            finite = torch.isfinite(loss.detach()).all()
            bad = bad + (~torch.isfinite(weight) | (weight < 0) | (live & ~finite)).to(torch.float64)
            # a weight-0 chunk backpropagates zero (FSDP's reduce-scatter needs every rank's backward)
            (torch.where(live, loss, loss.detach().nan_to_num(0.0) * 0) * (weight.to(loss.dtype) if token_sum
                                                                           else 1.0)).backward()
            weight_sum = weight_sum + weight
            loss_sum = loss_sum + torch.where(live, loss.detach().to(torch.float64) * weight, zero)
            for k in names:
                v = _device_scalar(metrics[k], self.device)
                agg = metric_aggregation(k)
                if agg == "mean":
                    sums[k] = sums[k] + torch.where(live, v * weight, zero)
                else:
                    extrema[k] = torch.maximum(extrema[k], torch.where(live, v if agg == "max" else -v, -math.inf))

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        mean_keys = sorted(sums)
        ext_keys = sorted(extrema)
        # on the model's device: NCCL reduces CUDA tensors only
        stats = torch.stack([weight_sum, loss_sum, bad] + [sums[k] for k in mean_keys])
        ext = torch.stack([extrema[k] for k in ext_keys]) if ext_keys else stats.new_zeros(0)
        if self.dp_reducer is not None:
            if not self.sharded:  # FSDP has reduce-scattered the gradients in backward
                all_reduce_in_buckets(grads, self.dp_reducer, self.GRAD_BUCKET_BYTES)
            self.dp_reducer.all_reduce_([stats])
            reduce_max = getattr(self.dp_reducer, "all_reduce_max_", None)
            if ext.numel() and reduce_max is not None:
                reduce_max([ext])
        for p, g in zip(self.params, grads):
            p.grad = g.div_(stats[0].to(g.dtype))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.optimizer_config.max_grad_norm)
        if is_dtensor(grad_norm):
            grad_norm = grad_norm.full_tensor()
        host = torch.cat([stats, ext, grad_norm.detach().reshape(1).to(torch.float64)]).tolist()  # the one copy
        total_weight, loss_total, n_bad = host[0], host[1], host[2]
        if n_bad:
            raise ValueError(f"{int(n_bad)} micro-batch(es) of this optimizer step had a non-finite loss or an objective "
                             "weight that is not a finite non-negative number; nothing was applied")
        if total_weight <= 0 and self.skip_empty_updates:  # every rank sees the global weight: all skip together
            for p in self.params:
                p.grad = None
            return {f"{self.metric_split}/{SKIPPED_UPDATES}": 1.0}
        if total_weight <= 0:
            raise ValueError("the global objective weight of this optimizer step is 0 (no loss tokens on any "
                             "micro-batch or rank); the batch should have been refused before dispatch")
        local: dict[str, float] = {k: v / total_weight for k, v in zip(mean_keys, host[3:3 + len(mean_keys)])}
        for k, v in zip(ext_keys, host[3 + len(mean_keys):-1]):
            local[k] = v if metric_aggregation(k) == "max" else -v
        out = objective.metric_adapter.publish(local, self.metric_split)
        if check_gap and self.max_rollout_logp_abs_diff is not None:
            self._check_gap(out)  # the same global value on every rank: all refuse together
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        out[f"{self.metric_split}/loss"] = loss_total / total_weight
        out[f"{self.metric_split}/grad_norm"] = host[-1]
        out[f"{self.metric_split}/lr"] = float(lr)
        return out

    def _check_gap(self, published: dict[str, float]) -> None:
        """Refuse the step when the mean |sampler log-prob - trainer log-prob| over the batch's loss tokens (all
        ranks) is above the bound (rollout.max_logp_abs_diff)."""
        bound, key = self.max_rollout_logp_abs_diff, f"{self.metric_split}/rollout_logp_abs_diff"
        if key not in published:
            raise KeyError(f"rollout.max_logp_abs_diff={bound:g} is set, but this objective reports no "
                           "rollout_logp_abs_diff to bound; unset rollout.max_logp_abs_diff")
        gap = published[key]
        if not gap <= bound:  # NaN is refused too
            raise SamplerGapError(
                f"rollout.max_logp_abs_diff={bound:g}: this batch's mean |sampler log-prob - trainer log-prob| "
                f"(rollout/logp_abs_diff) is {gap:.6g}, above the bound; the step was refused before any update "
                f"(trainer at policy version {self.policy_version}). The engines sampled from other weights or another "
                "distribution than the trainer computes (stale or corrupted weights, a temperature, top_p or kernel "
                "mismatch); raise the bound if this gap is expected (bfloat16 engines, rl.async_steps >= 1), else find "
                "the mismatch (docs/rollout.md)")


def _device_scalar(value, device: torch.device) -> torch.Tensor:
    """A metric (0-d tensor or number) as a 0-d float64 tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)
