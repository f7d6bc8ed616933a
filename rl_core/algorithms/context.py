"""What an objective builder needs to know beyond the `rl` config section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ObjectiveContext:
    """Inputs to `build_objective(rl, context)` that live outside `rl`.

    - `max_response_length`: the most sampled tokens of a row, `rollout.max_tokens` x `rollout.max_turns` (one
      turn for prompt tasks); the divisor of `seq-mean-token-sum-fixed` (there is no second config field for it).
    - `policy_identity`: what identifies the policy being trained (e.g. model name and dtype); copied
      into the objective's identity as provenance.
    - `temperature`: `rollout.temperature`, the temperature of the trainer's log-probs `log_softmax(logits / T)`:
      the rollout samples at it, so the importance ratio compares like with like (one key owns both).
    """

    max_response_length: int
    policy_identity: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0

    def __post_init__(self):
        if isinstance(self.max_response_length, bool) or not isinstance(self.max_response_length, int) \
                or self.max_response_length <= 0:
            raise ValueError(f"ObjectiveContext.max_response_length={self.max_response_length!r}: must be a positive "
                             "int (rollout.max_tokens x rollout.max_turns)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature > 0:
            raise ValueError(f"ObjectiveContext.temperature={self.temperature!r}: must be a positive number "
                             "(rollout.temperature)")

    @classmethod
    def from_config(cls, cfg) -> ObjectiveContext:
        """From a `PosttrainConfig`: `rollout.max_response_tokens`, the policy model's name and dtype,
        `rollout.temperature`."""
        return cls(
            max_response_length=cfg.rollout.max_response_tokens,
            policy_identity={"name_or_path": cfg.model.name_or_path, "compute_dtype": cfg.model.compute_dtype},
            temperature=cfg.rollout.temperature,
        )
