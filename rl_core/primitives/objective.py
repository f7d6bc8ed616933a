"""The Objective contract (docs/objectives.md): what an algorithm hands the trainer.

```
Objective(fn, reduction, metric_adapter, old_logp_cache=None, reference_scorer=None, identity={})
fn(model, batch) -> (loss, metrics)
```

- `Reduction.TOKEN_SUM`: `loss = chunk numerator / chunk weight` and `metrics[OBJECTIVE_WEIGHT_SUM]`
  holds that weight. The trainer backpropagates `loss × weight` (the numerator), sums numerators and
  weights over micro-batches and data-parallel ranks, and divides once by the global weight.
- `Reduction.MEAN`: `loss` is already a sample mean; the trainer divides by the global chunk count.
- Metrics are aggregated over chunks and ranks by name: a name ending in `_min` / `_max` takes the
  min / max, every other name the weight-average (chunk weight for TOKEN_SUM, 1 for MEAN). For the
  loss and its components (values of the form numerator / weight) this gives the unsplit value.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.primitives.logprobs import sequence_token_logprobs

OBJECTIVE_WEIGHT_SUM = "objective/weight_sum"


class Reduction(str, enum.Enum):
    MEAN = "mean"
    TOKEN_SUM = "token_sum"


def metric_aggregation(name: str) -> str:
    """How a metric combines over chunks and ranks: 'min', 'max' or 'mean' (weight-averaged)."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "mean"


SKIPPED_UPDATES = "skipped_updates"  # `<split>/skipped_updates`: optimizer steps of a batch left out (no loss token)


def combine_step_metrics(results: list[dict[str, float]], split: str) -> dict[str, float]:
    """Metrics of several optimizer steps on one batch: min/max for *_min/*_max, mean otherwise, over the steps that
    were applied; a skipped step (no loss token anywhere: `{<split>/skipped_updates: 1}`) only counts there."""
    skipped_key = f"{split}/{SKIPPED_UPDATES}"
    applied = [r for r in results if skipped_key not in r]
    out: dict[str, float] = {}
    for k in applied[0] if applied else ():
        values = [r[k] for r in applied]
        agg = metric_aggregation(k)
        out[k] = min(values) if agg == "min" else max(values) if agg == "max" else sum(values) / len(values)
    if len(applied) < len(results):
        out[skipped_key] = float(len(results) - len(applied))
    return out


@dataclass
class MetricAdapter:
    """Maps algorithm-local metric names to stable public names (`<split>/<public>`).

    `names`: local name -> public suffix, e.g. `{"grpo_clip_frac": "clip_frac"}` publishes
    `train/clip_frac`. `ignored`: local names deliberately not published. Any other emitted name is
    an error (raised on the first step, never a silent leak). `OBJECTIVE_WEIGHT_SUM` is bookkeeping,
    never published.
    """

    names: dict[str, str]
    ignored: frozenset[str] = frozenset()

    def __post_init__(self):
        self.ignored = frozenset(self.ignored)
        both = self.ignored & set(self.names)
        if both:
            raise ValueError(f"metric name(s) {sorted(both)} are both mapped and ignored")

    def unmapped(self, metrics: Mapping[str, Any]) -> list[str]:
        return sorted(k for k in metrics if k != OBJECTIVE_WEIGHT_SUM and k not in self.names and k not in self.ignored)

    def publish(self, metrics: Mapping[str, float], split: str = "train") -> dict[str, float]:
        unknown = self.unmapped(metrics)
        if unknown:
            raise KeyError(f"objective emitted metric(s) {unknown} that its MetricAdapter neither maps nor ignores; "
                           f"add them to MetricAdapter.names (public name) or MetricAdapter.ignored")
        return {f"{split}/{self.names[k]}": v for k, v in metrics.items() if k in self.names}


@dataclass(frozen=True)
class LogprobScorer:
    """Per-token log-probs `[B, T]` of a batch under a model at a fixed temperature, without grad.

    Used for π_old (the trainer's ahead pass) and for the frozen reference; the same primitive as
    the training forward, so values agree exactly for the same weights.
    """

    temperature: float

    def __call__(self, model: torch.nn.Module, batch) -> torch.Tensor:
        with torch.no_grad():
            return sequence_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                           temperature=self.temperature, loss_mask=batch.loss_mask)


def scalar_metrics(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scalar tensors as detached 0-d float64 tensors on their device; keys and order kept.

    They stay on the device: the trainer sums them over chunks and brings them to the host once per
    optimizer step (`float(v)` reads one where a caller needs a number).
    """
    return {k: v.detach().to(torch.float64).reshape(()) for k, v in values.items()}


def frozen_token_logprobs(model: torch.nn.Module, batch, *, temperature: float,
                          micro_batch_size: int | None = None) -> torch.Tensor:
    """A frozen model's (reference, teacher) per-token log-probs of a batch: `[B, T]` float32, 0 off the loss mask.

    `LogprobScorer(temperature)` — the training forward's primitive — through `frozen_scores`.
    """
    return frozen_scores(model, batch, LogprobScorer(temperature), micro_batch_size)


def frozen_scores(model: torch.nn.Module, batch, score: Callable[[torch.nn.Module, Any], torch.Tensor],
                  micro_batch_size: int | None = None) -> torch.Tensor:
    """`score(model, chunk) -> [b, T]` over a batch without grad, in chunks of `micro_batch_size` rows, on the
    model's device, as `[B, T]` float32, 0 off the loss mask; the model's train/eval mode is restored and the result
    is returned on the batch's device."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        chunks = batch.split(micro_batch_size) if micro_batch_size else [batch]
        with torch.no_grad():
            out = torch.cat([score(model, c.to(device)).float() for c in chunks], 0)
    finally:
        model.train(was_training)
    mask = batch.loss_mask.to(out.device, out.dtype)
    return (out * mask).to(batch.loss_mask.device)


class OldLogpCacheError(RuntimeError):
    """π_old log-probs requested that the cache does not hold (miss, stale or invalidated)."""


class NondeterministicForwardError(RuntimeError):
    """`certified_deterministic_forward`: the π_old pass and the training forward disagree."""


class OldLogpCache:
    """π_old per-token log-probs `[N, T]` of one collected batch, keyed by sample id (docs/objectives.md).

    Life cycle, driven by the trainer once per collected batch:
      `fill(sample_ids, logp, policy_version)`  the ahead pass, no grad, before the first update;
      or `fill_on_policy(sample_ids, policy_version)`  n_mini = 1: π_old is sg[ℓ] of the training forward;
      `lookup(sample_ids, policy_version, current_logp)`  every micro-batch of every mini-batch;
      `invalidate()`  when the batch is done; any later lookup raises.
    A second fill without `invalidate()` raises (one fill per collected batch). While `certify` is
    on (the trainer's first mini-batch under `certified_deterministic_forward`), `lookup` checks that
    the training forward equals the stored values: bit for bit on CPU, where the kernels are
    deterministic; within `accelerator_atol` on an accelerator, whose kernels may reduce in a different
    order between two identical forwards.
    """

    def __init__(self, scorer: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 certified_deterministic_forward: bool = False, accelerator_atol: float = 0.0):
        self.scorer = scorer
        self.certified_deterministic_forward = certified_deterministic_forward
        self.accelerator_atol = float(accelerator_atol)
        self.certify = False
        self.fills = 0
        self.lookups = 0
        self.certified_rows = 0
        self._mode = "empty"  # empty | filled | on_policy | invalidated
        self._version: int | None = None
        self._index: dict[int, int] = {}
        self._logp: torch.Tensor | None = None

    @property
    def mode(self) -> str:
        return self._mode

    def _start(self, sample_ids: torch.Tensor, policy_version: int) -> None:
        if self._mode in ("filled", "on_policy"):
            raise OldLogpCacheError(f"old_logp cache already holds the batch of policy_version={self._version}; "
                                    "call invalidate() before filling it for a new collected batch")
        ids = [int(s) for s in sample_ids.tolist()]
        if len(set(ids)) != len(ids):
            raise ValueError("sample_ids repeat within the collected batch; the old_logp cache keys rows by sample id")
        self._index = {s: i for i, s in enumerate(ids)}
        self._version = int(policy_version)
        self.fills += 1

    def fill(self, sample_ids: torch.Tensor, logp: torch.Tensor, policy_version: int) -> None:
        """Store π_old `[N, T]` for the `[N]` samples of one collected batch."""
        if logp.dim() != 2 or logp.shape[0] != sample_ids.shape[0]:
            raise ValueError(f"old_logp has shape {tuple(logp.shape)}; expected [{sample_ids.shape[0]}, T]")
        self._start(sample_ids, policy_version)
        self._logp = logp.detach()
        self._mode = "filled"

    def fill_on_policy(self, sample_ids: torch.Tensor, policy_version: int) -> None:
        """n_mini = 1 without certification: π_old is the current policy, `lookup` returns sg[current]."""
        self._start(sample_ids, policy_version)
        self._logp = None
        self._mode = "on_policy"

    def invalidate(self) -> None:
        self._mode = "invalidated" if self._mode != "empty" else "empty"
        self._logp = None
        self._index = {}
        self.certify = False

    def lookup(self, sample_ids: torch.Tensor, policy_version: int, current_logp: torch.Tensor) -> torch.Tensor:
        """π_old `[b, T]` for the `[b]` samples of a micro-batch; `current_logp` is its training forward."""
        if self._mode == "empty":
            raise OldLogpCacheError("old_logp missing: the old_logp cache was never filled for this batch (the trainer "
                                    "fills it before the first update; outside the trainer call fill()/fill_on_policy())")
        if self._mode == "invalidated":
            raise OldLogpCacheError("old_logp stale: the old_logp cache was invalidated after its batch was trained; "
                                    "it must be filled again for a new collected batch")
        if int(policy_version) != self._version:
            raise OldLogpCacheError(f"old_logp stale: the cache holds policy_version={self._version}, the micro-batch "
                                    f"has policy_version={int(policy_version)}")
        ids = [int(s) for s in sample_ids.tolist()]
        missing = [s for s in ids if s not in self._index]
        if missing:
            raise OldLogpCacheError(f"old_logp missing for sample_ids {missing[:8]}{' ...' if len(missing) > 8 else ''}: "
                                    "not part of the collected batch the cache was filled for")
        self.lookups += 1
        if self._mode == "on_policy":
            return current_logp.detach()
        rows = torch.tensor([self._index[s] for s in ids], dtype=torch.long)
        old = self._logp.index_select(0, rows.to(self._logp.device))
        if old.shape != current_logp.shape:
            raise OldLogpCacheError(f"old_logp stale: cached rows have shape {tuple(old.shape)}, the micro-batch "
                                    f"{tuple(current_logp.shape)}")
        if self.certify:
            cur = current_logp.detach()
            atol = self.certify_atol(cur.device)
            diff = (cur - old.to(cur.dtype)).abs()
            if not (torch.equal(cur, old.to(cur.dtype)) if atol == 0 else bool((diff <= atol).all())):
                bound = "bit for bit" if atol == 0 else f"within rl.certified_forward_atol={atol:g}"
                raise NondeterministicForwardError(
                    f"rl.certified_deterministic_forward: the pi_old pass and the training forward differ ({bound}) on "
                    f"the first mini-batch at {int((diff > atol).sum())} position(s), max |diff| = "
                    f"{float(diff.max()):.3e}; the forward is not deterministic (dropout, nondeterministic kernels, or a "
                    "changed micro-batch layout)")
            self.certified_rows += len(ids)
        return old

    def certify_atol(self, device: torch.device) -> float:
        """The certificate's tolerance on `device`: 0 (bitwise) on CPU, `accelerator_atol` elsewhere."""
        return 0.0 if torch.device(device).type == "cpu" else self.accelerator_atol


@dataclass
class Objective:
    """An algorithm's loss for the trainer. See the module docstring and docs/objectives.md.

    `fn(model, batch) -> (loss, metrics)`; `old_logp_cache` (ratio surrogates), `reference_scorer`
    (`scorer(reference_model, batch) -> [B, T]`, the network comes from the trainer's
    `auxiliary_models["reference"]`), `identity` (every value that changes the math), `multiple_updates` (the loss stays valid over
    several optimizer steps on one batch though it has no π_old, e.g. PPO's clipped value loss).
    """

    fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]
    reduction: Reduction
    metric_adapter: MetricAdapter
    old_logp_cache: OldLogpCache | None = None
    reference_scorer: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    multiple_updates: bool = False  # valid over several optimizer steps on one batch without π_old (a value loss)

    def __post_init__(self):
        if not isinstance(self.reduction, Reduction):
            raise TypeError(f"Objective.reduction={self.reduction!r}; expected a Reduction (MEAN or TOKEN_SUM)")
        if not callable(self.fn):
            raise TypeError("Objective.fn must be callable as fn(model, batch) -> (loss, metrics)")
