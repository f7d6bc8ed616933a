"""A reward-hacking check for learned rewards: the held-out reward rising while held-out accuracy falls.

A reward model (or judge) is a proxy; a policy that learns to please it rather than to be right shows as a held-out
reward that keeps rising while the accuracy that a rule (`data.success_reward`) measures falls. `HackingWatch`
compares each evaluation with the one before it and logs `val/reward_hacking`: 1.0 when `val/mean_reward` rose and
`val/accuracy` fell since then, else 0.0 (and names the change in a warning); the first evaluation of a run (or of
a resumed run) has nothing to compare with and logs 0.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HackingWatch:
    """`check(metrics)` after each held-out evaluation: the `val/reward_hacking` entry (module docstring)."""

    def __init__(self, warn: Callable[[str], Any] | None = None):
        self.previous: tuple[float, float] | None = None
        self.warn = warn

    def check(self, metrics: dict[str, Any]) -> dict[str, float]:
        reward, accuracy = float(metrics["val/mean_reward"]), float(metrics["val/accuracy"])
        before, self.previous = self.previous, (reward, accuracy)
        if before is None or not (reward > before[0] and accuracy < before[1]):
            return {"val/reward_hacking": 0.0}
        if self.warn is not None:
            self.warn(f"possible reward hacking: the held-out reward rose {before[0]:.4g} -> {reward:.4g} while "
                      f"held-out accuracy fell {before[1]:.4g} -> {accuracy:.4g} (val/reward_hacking=1): the policy "
                      "may be pleasing the reward model or judge rather than getting the answers right")
        return {"val/reward_hacking": 1.0}


__all__ = ["HackingWatch"]
