"""Reward functions, as TRL writes them: `fn(prompts, completions, **columns) -> list[float | None]`.

One call scores a batch: `prompts[i]` is the i-th completion's prompt as the dataset has it (text, or its
messages for a chat-format row), `completions[i]` its completion (text, or `[{"role": "assistant",
"content": text}]` for a chat-format row) and every other dataset column arrives as a keyword argument
holding one value per completion (`answer=[...]`). A function that does not take `**kwargs` receives only
the arguments it names (it must take `completions`). It returns one float per completion, or None where it does not apply.

`data.rewards` lists the functions with weights; unset, the task's own rewards score (weight 1). A
completion's reward is `Σ weight_f · r_f` over the functions that apply to it; a completion no function
applies to, an exception, a wrong-length result or a non-finite value is refused, naming the function and
the row. `per_completion` turns a `(completion, answer) -> float` function into one of these; `rl_core.rewards.configured`
resolves the functions of a config.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rl_core.user_code import call_user_code

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(ValueError):
    """A reward function failed or returned something that is not a reward; names the function and row."""


def per_completion(fn: Callable[[str, str], float]) -> RewardFn:
    """`fn(completion, answer) -> float` as a batched reward function."""

    def batched(prompts, completions, answer, **_):
        return [float(fn(completion_text(c), a)) for c, a in zip(completions, answer, strict=True)]

    # the name and docs, not functools.wraps: its __wrapped__ would give the batched function fn's signature
    batched.__name__ = batched.__qualname__ = getattr(fn, "__name__", "reward")
    batched.__doc__ = fn.__doc__
    return batched


@dataclass(frozen=True)
class RewardFunction:
    """One reward: its name (in metrics: `rollout/rewards/<name>/mean`), weight, function and config key; `model`,
    the entry of a reward model (scored by the cluster's reward-model role, `infra.workers.reward_model`)."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    key: str = "data.task"
    model: Any = None  # a reward model's or judge's `data.rewards` entry (`fn`: its ModelReward or JudgeReward)


@dataclass
class RewardInputs:
    """What the reward functions receive for one batch, and where each completion's prompt came from."""

    prompts: list[Any]
    completions: list[Any]
    columns: dict[str, list[Any]]
    rows: list[str]

    def __len__(self) -> int:
        return len(self.completions)

    def part(self, start: int, stop: int) -> RewardInputs:
        return RewardInputs(self.prompts[start:stop], self.completions[start:stop],
                            {k: v[start:stop] for k, v in self.columns.items()}, self.rows[start:stop])


def reward_inputs(examples: Sequence[Any], texts: Sequence[str], episodes: Sequence[dict] | None = None) -> RewardInputs:
    """The inputs of `texts[i]`, the completion of `examples[i]` (a `rl_core.tasks.Example`).

    `episodes[i]` (an agent task's episode records, `rl_core.agents.Episode.record`): the prompt is the episode's
    opening messages and the completion the rest of the conversation in TRL's form (assistant turns with their
    `tool_calls`, `tool` results, the environment's messages); the environment's reward is the column
    `environment_reward`."""
    prompts, completions, rows = [], [], []
    columns: dict[str, list[Any]] = {}
    names = list(dict.fromkeys(k for ex in examples for k in ex.reward_columns()))
    for i, (ex, text) in enumerate(zip(examples, texts, strict=True)):
        chat = ex.messages is not None
        if episodes is not None:
            prompts.append([dict(m) for m in episodes[i]["prompt"]])
            completions.append([dict(m) for m in episodes[i]["completion"]])
        else:
            prompts.append([dict(m) for m in ex.messages] if chat else ex.prompt)
            completions.append([{"role": "assistant", "content": text}] if chat else text)
        rows.append(ex.row or f"prompt {i}")
        values = ex.reward_columns()
        for name in names:
            columns.setdefault(name, []).append(values.get(name))
    if episodes is not None:
        columns["environment_reward"] = [float(e["reward"]) for e in episodes]
    return RewardInputs(prompts, completions, columns, rows)


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or the content of the last message of a conversational one."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _accepted(fn: Callable, columns: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: pass everything
        return columns
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return columns
    return {k: v for k, v in columns.items() if k in params}


def call_reward(f: RewardFunction, inputs: RewardInputs, offset: int = 0) -> list[float | None]:
    """`f` on the batch, checked: one finite float or None per completion, else RewardError naming the row."""
    n = len(inputs)
    # what the function raises is described by `user_code.user_error` (credentials removed) and raised as a
    # RewardError naming the function and the rows, with nothing of the original chained to it
    out = call_user_code(f"reward {f.name!r} ({f.key})", f.fn,
                         kwargs=_accepted(f.fn, {"prompts": inputs.prompts, "completions": inputs.completions,
                                                 **inputs.columns}),
                         error=RewardError, hint=f" (scoring {n} completions, the first from "
                                                 f"{inputs.rows[0] if n else '-'}); fix the function or the data")
    try:
        values = list(out)
    except TypeError:
        raise RewardError(f"reward {f.name!r} ({f.key}) returned a {type(out).__name__}, not a list of {n} "
                          "floats (one per completion)") from None
    if len(values) != n:
        raise RewardError(f"reward {f.name!r} ({f.key}) returned {len(values)} values for {n} completions; return "
                          "one float (or None) per completion")
    checked: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            checked.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise RewardError(f"reward {f.name!r} ({f.key}) returned {value!r:.40} for completion {offset + i} "
                              f"({inputs.rows[i]}); return a float or None")
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(f"reward {f.name!r} ({f.key}) returned {number} for completion {offset + i} "
                              f"({inputs.rows[i]}); a reward is a finite float (None: not applicable)")
        checked.append(number)
    return checked


def combine(functions: Sequence[RewardFunction], per_function: Sequence[Sequence[float | None]],
            rows: Sequence[str]) -> list[float]:
    """`Σ_f weight_f · r_f` per completion over the functions that apply; RewardError for a row none applies to."""
    totals = []
    for i, row in enumerate(rows):
        applicable = [(f.weight, values[i]) for f, values in zip(functions, per_function, strict=True)
                      if values[i] is not None]
        if not applicable:
            names = ", ".join(repr(f.name) for f in functions)
            raise RewardError(f"completion {i} ({row}): every reward function returned None ({names}); at least "
                              "one must score each completion")
        totals.append(sum(w * v for w, v in applicable))
    return totals


def function_means(functions: Sequence[RewardFunction],
                   per_function: Sequence[Sequence[float | None]]) -> dict[str, float]:
    """`rollout/rewards/<name>/mean` over the completions each function applied to (NaN when none)."""
    out = {}
    for f, values in zip(functions, per_function, strict=True):
        scored = [v for v in values if v is not None]
        out[f"rollout/rewards/{f.name}/mean"] = sum(scored) / len(scored) if scored else math.nan
    return out


@dataclass
class Scores:
    """A scored batch: `rewards[i]` completion i's reward (`combine`), `means` each function's mean
    (`function_means`) and `values[name][i]` function `name`'s own value for completion i (None: it did not apply),
    the functions in their configured order."""

    rewards: list[float]
    means: dict[str, float]
    values: dict[str, list[float | None]]


def scored(functions: Sequence[RewardFunction], per_function: Sequence[Sequence[float | None]],
           rows: Sequence[str]) -> Scores:
    """The `Scores` of a batch from each function's values (`per_function[j]`: function j's, one per completion)."""
    return Scores(combine(functions, per_function, rows), function_means(functions, per_function),
                  {f.name: list(values) for f, values in zip(functions, per_function, strict=True)})


def score_batch(functions: Sequence[RewardFunction], inputs: RewardInputs) -> Scores:
    """Every function on the whole batch in this process."""
    return scored(functions, [call_reward(f, inputs) for f in functions], inputs.rows)


SUCCESS_VALUE = 1.0  # full marks: a held-out completion is correct when the success reward gives it at least this


def success_reward(chosen: str | None, names: Sequence[str]) -> str:
    """The reward whose own value decides a held-out completion's correctness: `chosen` (`data.success_reward`),
    else the first of the configured rewards' `names` (in order: an environment's own, then `data.rewards`, or the
    task's own)."""
    if chosen is not None:
        if chosen not in names:
            raise ValueError(f"data.success_reward={chosen!r}: no reward of that name; the rewards are "
                             f"{', '.join(map(repr, names)) or 'none'}")
        return chosen
    if not names:
        raise ValueError("no reward functions: nothing decides correctness (data.rewards is empty and the task has none)")
    return names[0]


def successes(scores: Scores, name: str) -> list[bool]:
    """Whether each completion is correct: reward `name`'s own value is at least `SUCCESS_VALUE` (None: not)."""
    return [v is not None and v >= SUCCESS_VALUE for v in scores.values[name]]


def score(functions: Sequence[RewardFunction], inputs: RewardInputs) -> tuple[list[float], dict[str, float]]:
    """Every function on the whole batch in this process: `(rewards, per-function means)`."""
    out = score_batch(functions, inputs)
    return out.rewards, out.means


__all__ = ["SUCCESS_VALUE", "RewardError", "RewardFn", "RewardFunction", "RewardInputs", "Scores", "call_reward",
           "combine", "function_means", "per_completion", "reward_inputs", "score", "score_batch", "scored",
           "success_reward", "successes"]
