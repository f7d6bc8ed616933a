"""Dynamic sampling (DAPO's filter_groups, `rollout.filter_groups`): which groups a step trains on, over rounds.

A group g of n rewards r_g1..r_gn is *useful* when they spread beyond the band b (`rollout.filter_reward_std_min`):

    s_g = sqrt( (1/n) sum_j (r_gj - mean_g)^2 ),  s_g = 0 exactly when every r_gj is equal;   useful  <=>  s_g > b

A group whose rewards are all equal has a zero group-relative advantage on every completion: it adds nothing to
the policy gradient, yet its tokens count in the loss's divisor and shrink the step of the groups that teach.

Round 0 is the step's own draw of P = `rollout.prompts_per_step` prompts. While fewer than P groups are useful and
fewer than `rollout.filter_max_rounds` extra rounds have run, another round draws the sampler's next

    m = P                                    when no group was useful so far,
    m = min(P, ceil((P - K) * G / K))        otherwise (K useful of G generated groups: the rate so far),

prompts (at most P, so no round is larger than a step's normal batch). The batch is the first P useful groups in
generation order. Short of P when the rounds run out, the fallback decides: `train` takes the K useful groups, then
the first P - K dropped ones as *padding* (in the batch, left out of the loss: weight 0, so the batch keeps its
P x n rows, the shape the ranks, mini- and micro-batches split, and the objective's reductions count only the
useful rows); `skip` trains nothing this step. With K = 0 there is nothing to train under either fallback.

Every choice depends only on the rewards, so with per-round seeds derived from the step's (the flow's) a resumed
run regenerates exactly the same rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from rl_core.rewards import Scores
from rl_core.rollout.base import Completions, concat_completions


def group_spread(rewards: Sequence[float], group_ids: Sequence[int]) -> dict[int, float]:
    """The population std of each group's rewards (0.0 exactly when they are all equal), by group id."""
    members: dict[int, list[float]] = {}
    for g, r in zip(group_ids, rewards, strict=True):
        members.setdefault(int(g), []).append(float(r))
    out = {}
    for g, values in members.items():
        if max(values) == min(values):
            out[g] = 0.0
            continue
        mean = sum(values) / len(values)
        out[g] = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return out


def useful_groups(rewards: Sequence[float], group_ids: Sequence[int], std_min: float = 0.0) -> dict[int, bool]:
    """Whether each group is useful: the population std of its rewards is above `std_min`."""
    return {g: s > std_min for g, s in group_spread(rewards, group_ids).items()}


def group_pass_rates(successes: Sequence[bool], group_ids: Sequence[int]) -> dict[int, float]:
    """Each group's share of successes (the curriculum sampler's observation), by group id."""
    hits: dict[int, list[int]] = {}
    for g, ok in zip(group_ids, successes, strict=True):
        hits.setdefault(int(g), []).append(int(bool(ok)))
    return {g: sum(v) / len(v) for g, v in hits.items()}


def next_round_size(target: int, kept: int, generated: int) -> int:
    """Prompts of the next round: `target` when nothing was useful yet, else `min(target, ceil((target - kept) *
    generated / kept))`."""
    if kept >= target:
        return 0
    if kept == 0:
        return target
    return min(target, -(-(target - kept) * generated // kept))


def select_groups(completions: Completions, groups: Sequence[int]) -> Completions:
    """The rows of `groups` (prompt indices of `completions`), in that order, renumbered 0..len(groups)-1 (their
    episodes' earlier samples with them)."""
    index = completions.prompt_index
    rows_of = [torch.nonzero(index == int(g)).flatten().tolist() for g in groups]
    picked = completions.rows([r for rows in rows_of for r in rows])
    picked.prompt_index = torch.tensor([i for i, rows in enumerate(rows_of) for _ in rows], dtype=torch.long)
    return picked


@dataclass
class Round:
    """One generation round: the dataset row of each of its prompts, their completions, scores and successes (the
    success reward's full marks, per completion)."""

    rows: list[int]
    completions: Completions
    scores: Scores
    successes: list[bool]

    def group_ids(self) -> list[int]:
        return self.completions.prompt_index.tolist()


def round_pass_rates(gathered: Round) -> tuple[list[int], list[float]]:
    """A round's (dataset rows, group pass rates) in prompt order: what the curriculum sampler observes."""
    rates = group_pass_rates(gathered.successes, gathered.group_ids())
    return [gathered.rows[g] for g in sorted(rates)], [rates[g] for g in sorted(rates)]


@dataclass
class Selected:
    """The step's batch: its groups' dataset rows, completions (rows grouped, renumbered), scores (`means` over the
    trained groups only) and `padding`, the batch's group indices left out of the loss."""

    rows: list[int]
    completions: Completions
    scores: Scores
    padding: list[int] = field(default_factory=list)


@dataclass
class DynamicSampling:
    """The rounds of one step, the useful groups they gathered and the batch they make (module docstring)."""

    target: int
    std_min: float = 0.0
    max_rounds: int = 3
    fallback: Literal["train", "skip"] = "train"
    rounds: list[Round] = field(default_factory=list)
    verdicts: list[dict[int, bool]] = field(default_factory=list)

    def add(self, gathered: Round) -> dict[int, bool]:
        """Score a round's groups; each group's verdict (useful or not), by its prompt index in the round."""
        verdict = useful_groups(gathered.scores.rewards, gathered.group_ids(), self.std_min)
        self.rounds.append(gathered)
        self.verdicts.append(verdict)
        return verdict

    @property
    def useful(self) -> int:
        return sum(sum(v.values()) for v in self.verdicts)

    @property
    def generated(self) -> int:
        return sum(len(v) for v in self.verdicts)

    def wants_more(self) -> bool:
        """Short of `target` useful groups, with extra rounds left."""
        return self.useful < self.target and len(self.rounds) - 1 < self.max_rounds

    def next_size(self) -> int:
        return next_round_size(self.target, self.useful, self.generated)

    def _pick(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(useful groups of the batch, padding groups), each as (round, prompt index), in generation order."""
        useful = [(r, g) for r, v in enumerate(self.verdicts) for g in sorted(v) if v[g]][: self.target]
        if len(useful) == self.target or self.fallback == "skip" or not useful:
            return useful, []
        dropped = [(r, g) for r, v in enumerate(self.verdicts) for g in sorted(v) if not v[g]]
        return useful, dropped[: self.target - len(useful)]

    def skipped(self) -> bool:
        """The step trains nothing: no useful group, or short of `target` under the `skip` fallback."""
        useful, _ = self._pick()
        return not useful or (len(useful) < self.target and self.fallback == "skip")

    def select(self) -> Selected | None:
        """The step's batch, or None when it trains nothing (`skipped`)."""
        if self.skipped():
            return None
        useful, padding = self._pick()
        parts, rows, picked = [], [], []  # picked: (round, row of the round) of every batch row, in order
        for chosen in (useful, padding):
            for r, gathered in enumerate(self.rounds):
                groups = [g for (rr, g) in chosen if rr == r]
                if not groups:
                    continue
                parts.append(select_groups(gathered.completions, groups))
                rows.extend(gathered.rows[g] for g in groups)
                index = gathered.completions.prompt_index
                picked.extend((r, i) for g in groups for i in torch.nonzero(index == g).flatten().tolist())
        completions = concat_completions(parts)
        trained = len(useful) * completions.n
        scores = _scores_of([self.rounds[r].scores for r, _ in picked], [i for _, i in picked], trained)
        return Selected(rows, completions, scores, list(range(len(useful), len(useful) + len(padding))))

    def stats(self) -> dict[str, float]:
        """`rollout/filter/*`: extra rounds, prompts / completions / response tokens generated, the useful share, the
        dropped groups by reason (every completion a success, none, or another spread within the band), the groups
        the batch trains and pads, whether the step was skipped, and the mean reward of everything generated."""
        dropped = {"all_correct": 0, "all_wrong": 0, "other": 0}
        for gathered, verdict in zip(self.rounds, self.verdicts):
            rates = group_pass_rates(gathered.successes, gathered.group_ids())
            for g, ok in verdict.items():
                if not ok:
                    dropped["all_correct" if rates[g] == 1.0 else "all_wrong" if rates[g] == 0.0 else "other"] += 1
        useful, padding = self._pick()
        skipped = self.skipped()
        rewards = [r for gathered in self.rounds for r in gathered.scores.rewards]
        out = {"rollout/filter/rounds": float(len(self.rounds) - 1),
               "rollout/filter/generated_prompts": float(self.generated),
               "rollout/filter/generated_completions": float(len(rewards)),
               "rollout/filter/generated_tokens": float(sum(int(g.completions.response_lengths.sum())
                                                            for g in self.rounds)),
               "rollout/filter/kept_frac": self.useful / self.generated if self.generated else 0.0,
               "rollout/filter/trained_groups": 0.0 if skipped else float(len(useful)),
               "rollout/filter/padded_groups": 0.0 if skipped else float(len(padding)),
               "rollout/filter/skipped_step": float(skipped),
               "rollout/filter/generated_reward_mean": sum(rewards) / len(rewards) if rewards else math.nan}
        out.update({f"rollout/filter/dropped_{reason}": float(count) for reason, count in dropped.items()})
        return out


def _scores_of(sources: list[Scores], rows: list[int], trained: int) -> Scores:
    """Row `rows[k]` of `sources[k]`'s scores, for every k; the per-function means over the first `trained` rows."""
    names = list(sources[0].values) if sources else []
    values = {name: [s.values[name][i] for s, i in zip(sources, rows)] for name in names}
    means = {}
    for name in names:
        scored = [v for v in values[name][:trained] if v is not None]
        means[f"rollout/rewards/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
    return Scores([s.rewards[i] for s, i in zip(sources, rows)], means, values)
