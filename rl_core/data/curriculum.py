"""The curriculum sampler (`data.sampler=curriculum`): prompts drawn by how much their groups still teach.

Each train prompt i keeps a pass rate p_i, the share of its group's completions that the success reward gives full
marks (`data.success_reward`), smoothed over the steps that drew it:

    unseen:             p_i = 1/2                                       (the prior: the largest weight)
    first observation:  p_i = x                                          (x: the group's share of successes)
    later:              p_i = (1 - a) p_i + a x                          (a = data.curriculum_ema)

and is drawn with probability

    q_i = w_i / sum_j w_j,    w_i = f + p_i (1 - p_i)                    (f = data.curriculum_floor > 0)

p(1 - p) is the variance of a success: largest for prompts solved half the time, zero for those always or never
solved, whose groups carry no group-relative signal; the floor keeps every prompt drawable. A batch is
`batch_size` distinct prompts (numpy `Generator.choice` without replacement; more than the pool: whole pools one
after another). The generator is numpy's PCG64 seeded with `[seed, 1]`; `state_dict()` holds its bit-generator
state and the pass-rate table, so a restored sampler draws exactly the prompts the uninterrupted one draws.
"""

from __future__ import annotations

import numpy as np

PRIOR = 0.5  # the pass rate of a prompt no step has drawn yet: p(1 - p) at its largest
KIND = "curriculum"


def curriculum_weights(pass_rates: np.ndarray, floor: float) -> np.ndarray:
    """The draw probabilities `q_i = (f + p_i (1 - p_i)) / sum_j (f + p_j (1 - p_j))`."""
    p = np.asarray(pass_rates, dtype=np.float64)
    w = floor + p * (1.0 - p)
    return w / w.sum()


class CurriculumSampler:
    """Same interface as `PromptSampler` (`next_batch`, `observe`, `state_dict`, `load_state_dict`)."""

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0, *, floor: float = 0.05, ema: float = 0.5):
        if num_examples < 1:
            raise ValueError(f"num_examples={num_examples}: the prompt set is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not floor > 0:
            raise ValueError(f"floor={floor} must be > 0 (no prompt may be starved)")
        if not 0 < ema <= 1:
            raise ValueError(f"ema={ema} must be in (0, 1]")
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.floor = float(floor)
        self.ema = float(ema)
        self.pass_rate = np.full(self.num_examples, PRIOR, dtype=np.float64)
        self.seen = np.zeros(self.num_examples, dtype=bool)
        self.rng = np.random.default_rng([self.seed, 1])

    def probabilities(self) -> np.ndarray:
        return curriculum_weights(self.pass_rate, self.floor)

    def next_batch(self, count: int | None = None) -> list[int]:
        """The next `count` (default `batch_size`) prompt indices, distinct within each pool's worth."""
        count = self.batch_size if count is None else int(count)
        q = self.probabilities()
        out: list[int] = []
        while len(out) < count:
            take = min(count - len(out), self.num_examples)
            out.extend(int(i) for i in self.rng.choice(self.num_examples, size=take, replace=False, p=q))
        return out

    def observe(self, rows: list[int], pass_rates: list[float]) -> None:
        """Fold each drawn prompt's group pass rate (its share of successes, in [0, 1]) into its table entry, in
        order."""
        for row, x in zip(rows, pass_rates, strict=True):
            x = float(x)
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"pass rate {x} of prompt {row} is outside [0, 1]")
            self.pass_rate[row] = (1 - self.ema) * self.pass_rate[row] + self.ema * x if self.seen[row] else x
            self.seen[row] = True

    def state_dict(self) -> dict:
        return {"kind": KIND, "num_examples": self.num_examples, "batch_size": self.batch_size, "seed": self.seed,
                "floor": self.floor, "ema": self.ema, "rng": self.rng.bit_generator.state,
                "pass_rate": self.pass_rate.copy(), "seen": self.seen.copy()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != KIND:
            raise ValueError("the checkpoint's sampler state is not a curriculum sampler's; resume with the "
                             "data.sampler the run started with")
        for key in ("num_examples", "batch_size", "seed", "floor", "ema"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {getattr(self, key)}; "
                                 "resume with the same data split, batch size, seed and curriculum knobs")
        pass_rate = np.asarray(state["pass_rate"], dtype=np.float64)
        seen = np.asarray(state["seen"], dtype=bool)
        if pass_rate.shape != (self.num_examples,) or seen.shape != (self.num_examples,):
            raise ValueError(f"sampler state holds {pass_rate.shape[0]} pass rates for {self.num_examples} prompts")
        self.pass_rate, self.seen = pass_rate.copy(), seen.copy()
        self.rng.bit_generator.state = state["rng"]
