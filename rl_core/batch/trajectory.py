"""The training batch: a dataclass of tensors, one row per completion.

Layout (every `[B, T]` field shares the same `B` and `T`):
- `input_ids [B, T]` long: left-padded prompt + response, padding after EOS.
- `attention_mask [B, T]`: 1 on real tokens.
- `loss_mask [B, T]` float: 1 on response tokens up to and including EOS (a subset of attention_mask).
- `rollout_logp [B, T]` float32: the engine's sampling log-prob of token t at position t; 0 off the mask.
- `rewards [B]`, `group_ids [B]` long, `sample_ids [B]` long (unique), `policy_version` int.
- `advantages [B]` or `[B, T]`: set by the annotate stage (None before).
- `old_logp`, `ref_logp`, `teacher_logp [B, T]`: optional per-token log-probs of π_old / reference / teacher.
- `old_values`, `returns [B, T]`: optional, PPO's critic values when the batch was collected and the GAE returns
  that are its targets (`rl_core.algorithms.ppo`); `turn_rewards [B, T]`: agent turns' own rewards on their last
  tokens (`Reply.reward`), 0 off the loss mask.
- `routes [B, T, L, k]` uint8, optional: a mixture-of-experts model's per-token input, the experts of every token
  in every layer (`rl_core.model.routing`); the trainer binds it around the forward, an objective never reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_TOKEN_FIELDS = ("attention_mask", "loss_mask", "rollout_logp")
_OPTIONAL_TOKEN_FIELDS = ("old_logp", "ref_logp", "teacher_logp", "old_values", "returns", "turn_rewards")
_ROW_FIELDS = ("rewards", "group_ids", "sample_ids")


class TrajectoryError(ValueError):
    """A batch whose fields do not fit together; the message names the field."""


@dataclass
class Trajectory:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logp: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    policy_version: int
    advantages: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    def __post_init__(self):
        self.validate()

    # -- checks
    def validate(self) -> None:
        """Shapes and dtypes; raises TrajectoryError naming the field."""
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise TrajectoryError(f"input_ids must be a [B, T] tensor, got {_describe(ids)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TrajectoryError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        b, t = ids.shape
        for name in _TOKEN_FIELDS + _OPTIONAL_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_TOKEN_FIELDS:
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b, t):
                raise TrajectoryError(f"{name} must have shape [{b}, {t}] like input_ids, got {_describe(value)}")
        for name in ("loss_mask", "rollout_logp") + _OPTIONAL_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and not value.dtype.is_floating_point:
                raise TrajectoryError(f"{name} must be floating point, got dtype {value.dtype}")
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b,):
                raise TrajectoryError(f"{name} must have shape [{b}] (one per row of input_ids), got {_describe(value)}")
        for name in ("group_ids", "sample_ids"):
            if getattr(self, name).dtype.is_floating_point:
                raise TrajectoryError(f"{name} must be integer, got dtype {getattr(self, name).dtype}")
        if self.advantages is not None:
            adv = self.advantages
            if not isinstance(adv, torch.Tensor) or tuple(adv.shape) not in ((b,), (b, t)):
                raise TrajectoryError(f"advantages must have shape [{b}] or [{b}, {t}], got {_describe(adv)}")
        routes = self.routes
        if routes is not None and (not isinstance(routes, torch.Tensor) or routes.dim() != 4
                                   or tuple(routes.shape[:2]) != (b, t) or routes.dtype != torch.uint8):
            raise TrajectoryError(f"routes must be a [{b}, {t}, layers, top_k] uint8 tensor, got {_describe(routes)}")
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int):
            raise TrajectoryError(f"policy_version must be an int, got {self.policy_version!r}")
        if b and bool(((self.loss_mask != 0) & (self.attention_mask == 0)).any()):
            raise TrajectoryError("loss_mask is 1 where attention_mask is 0: loss tokens must be real tokens")

    # -- shape
    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def __len__(self) -> int:
        return self.batch_size

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def per_token_advantages(self) -> bool:
        return self.advantages is not None and self.advantages.dim() == 2

    # -- derived batches
    def replace(self, **changes) -> Trajectory:
        return dataclasses.replace(self, **changes)

    def _map_rows(self, fn) -> Trajectory:
        values = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return Trajectory(**values)

    def select(self, indices: Sequence[int] | torch.Tensor) -> Trajectory:
        """The rows `indices` (in that order), e.g. one data-parallel worker's share."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if idx.dim() != 1:
            raise TrajectoryError(f"select() takes a 1-D list of row indices, got shape {tuple(idx.shape)}")
        return self._map_rows(lambda v: v.index_select(0, idx.to(v.device)))

    def slice(self, start: int, stop: int) -> Trajectory:
        """Rows `start:stop` (views, no copy)."""
        return self._map_rows(lambda v: v[start:stop])

    def split(self, micro_batch_size: int) -> list[Trajectory]:
        """Consecutive chunks of `micro_batch_size` rows; the last one may be shorter."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise TrajectoryError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        return [self.slice(s, min(s + micro_batch_size, self.batch_size))
                for s in range(0, self.batch_size, micro_batch_size)]

    def token_budget_split(self, max_tokens: int, max_rows: int | None = None) -> list[Trajectory]:
        """Micro-batches of whole rows, longest first, each holding at most `max_tokens` tokens once unpadded.

        A micro-batch's tokens are its rows times its longest row's real tokens (`attention_mask`),
        the size of the unpadded forward (`rl_core.primitives.logprobs`); rows are sorted by length
        (ties in row order) and filled greedily, so rows of similar length share a micro-batch.
        `max_rows` caps the rows of one micro-batch too. A row longer than `max_tokens` is refused.
        """
        for name, value in (("max_tokens", max_tokens), ("max_rows", max_rows)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise TrajectoryError(f"{name} must be a positive int, got {value!r}")
        lengths = self.attention_mask.sum(-1).tolist()
        order = sorted(range(self.batch_size), key=lambda i: (-lengths[i], i))
        if order and lengths[order[0]] > max_tokens:
            raise TrajectoryError(f"row {order[0]} holds {lengths[order[0]]} tokens, more than the micro-batch budget "
                                  f"of {max_tokens} (rl.micro_batch_max_tokens): raise it to at least the longest prompt + response")
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            if g and (len(g) + 1) * lengths[g[0]] <= max_tokens and (max_rows is None or len(g) < max_rows):
                g.append(i)
            else:
                groups.append([i])
        return [self.select(g) for g in groups]

    def padding_budget(self, waste: float = 2.0) -> int | None:
        """The token budget a train step uses with no micro-batch option set (`LLMTrainer.train_step`): None while the
        rows at the width of the longest cost at most `waste` times their real tokens (one chunk, rows in order, as
        with no budget); else the larger of the longest row and the real tokens, so that rows are grouped by length
        (`token_budget_split`) and a few long rows do not widen every short one. Never more than the padded
        chunk it replaces: within what the memory plan allowed for it."""
        lengths = self.attention_mask.sum(-1)
        longest, real = int(lengths.max()) if lengths.numel() else 0, int(lengths.sum())
        if self.batch_size * longest <= waste * real:
            return None
        return max(longest, real)

    def to(self, device: torch.device | str) -> Trajectory:
        return self._map_rows(lambda v: v.to(device))

    @classmethod
    def concat(cls, batches: Sequence[Trajectory]) -> Trajectory:
        """Row-wise concatenation (same T, same policy_version, same optional fields present)."""
        if not batches:
            raise TrajectoryError("concat() needs at least one batch")
        versions = {b.policy_version for b in batches}
        if len(versions) != 1:
            raise TrajectoryError(f"policy_version differs across batches: {sorted(versions)}")
        values = {}
        for f in dataclasses.fields(cls):
            vs = [getattr(b, f.name) for b in batches]
            if f.name == "policy_version":
                values[f.name] = vs[0]
            elif all(v is None for v in vs):
                values[f.name] = None
            elif any(v is None for v in vs):
                raise TrajectoryError(f"{f.name} is set on some batches and missing on others")
            else:
                values[f.name] = torch.cat(vs, 0)
        return cls(**values)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)} dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:80]
