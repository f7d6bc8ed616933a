"""Seeded, epoch-aware prompt sampler with exact resume.

Epoch `e` visits every index once in the order `permutation(seed, e)` (numpy `default_rng([seed,
e])`); a batch that runs past the end of an epoch continues into the next one, so `next_batch()`
always returns exactly `batch_size` indices (never an empty batch at an epoch boundary).
`state_dict()` is `(epoch, cursor)` plus the identity of the stream; restoring it continues the
exact same sequence. `next_batch(count)` takes `count` indices of the same stream instead (dynamic sampling's extra
rounds, `docs/rollout.md`); `observe` is the curriculum sampler's feedback (`rl_core.data.curriculum`), which this
order does not read. `build_sampler` makes the one `data.sampler` names.
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    def __init__(self, num_examples: int, batch_size: int, seed: int = 0):
        if num_examples < 1:
            raise ValueError(f"num_examples={num_examples}: the prompt set is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)

    def next_batch(self, count: int | None = None) -> list[int]:
        """The next `count` (default `batch_size`) example indices."""
        count = self.batch_size if count is None else int(count)
        out: list[int] = []
        while len(out) < count:
            if self.cursor == self.num_examples:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.num_examples - self.cursor)
            out.extend(int(i) for i in self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def observe(self, rows: list[int], pass_rates: list[float]) -> None:
        """The epoch order does not depend on what the groups scored."""

    def state_dict(self) -> dict:
        return {
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind", "epoch") != "epoch":
            raise ValueError(f"the checkpoint's sampler state is a {state['kind']} sampler's; resume with the "
                             "data.sampler the run started with")
        for key in ("num_examples", "batch_size", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {getattr(self, key)}; "
                    "resume with the same data split, batch size and seed"
                )
        cursor = int(state["cursor"])
        if not 0 <= cursor <= self.num_examples:
            raise ValueError(f"sampler state cursor={cursor} is outside [0, {self.num_examples}]")
        self.epoch = int(state["epoch"])
        self.cursor = cursor
        self._order = self._permutation(self.epoch)


def build_sampler(data, num_examples: int, batch_size: int, seed: int):
    """The prompt sampler `data.sampler` names: the epoch order (`PromptSampler`) or the curriculum
    (`rl_core.data.curriculum.CurriculumSampler`, with `data.curriculum_floor` and `data.curriculum_ema`)."""
    if data.sampler == "curriculum":
        from rl_core.data.curriculum import CurriculumSampler

        return CurriculumSampler(num_examples, batch_size, seed, floor=data.curriculum_floor, ema=data.curriculum_ema)
    return PromptSampler(num_examples, batch_size, seed)
