"""Episodes on a rollout engine: every live episode advances one turn per batched engine call, until all have ended;
then the episodes become `Completions` whose response mask has holes where the environment's tokens are.

Each turn is one `engine.generate(contexts, 1, sampling)` over the live episodes' token ids (no text, no chat
template: the contexts are `Episode.ids`), with `max_tokens` the largest budget left among them; a row that
sampled past its own episode's budget is cut there and counts as not stopped. The seed of turn `t` is derived
from the step's seed and `t` (`turn_seed`), and each row's from it and the row's place among the live episodes
(`completion_seeds`): a rollout repeats exactly for the same episodes, seed and weights.

Layout of the result (`episodes_to_completions`), `P` the longest opening prompt, `R` the longest rest:

    input_ids       the opening prompt left-padded to P, then the turns and the environment's deltas
    attention_mask  1 on every real token (the environment's included: the policy reads them)
    response_mask   1 on sampled tokens only (`Episode.sampled`): 0 on the environment's tokens
    sampling_logp   the sampler's log-prob of each sampled token, 0 elsewhere
    finish_reason   'stop' for an episode the environment ended, 'length' for a truncated one
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from rl_core.agents.episode import Episode
from rl_core.rollout.base import SEED_MODULUS, Completions, RolloutEngine, SamplingParams


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a step seeded `seed` (unrelated streams for neighbouring turns)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (turn + 1) * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 31
    return int(x % SEED_MODULUS)


class EpisodeRun(NamedTuple):
    calls: int  # engine calls: the most turns of any episode
    generate_s: float  # seconds inside the engines' generate, summed over the calls
    policy_version: int  # the one policy version every call sampled with


def run_episodes(engine: RolloutEngine, episodes: list[Episode], sampling: SamplingParams) -> EpisodeRun:
    """Sample every episode to its end (`sampling.max_tokens`: per turn), checking that every engine call sampled
    with one policy version."""
    calls, generate_s, versions = 0, 0.0, set()
    while live := [e for e in episodes if not e.done]:
        budgets = [e.turn_budget(sampling.max_tokens) for e in live]
        if min(budgets) < 1:
            raise RuntimeError("a live episode has no token left for its next turn")  # Episode ends it before
        params = replace(sampling, max_tokens=max(budgets),
                         seed=None if sampling.seed is None else turn_seed(sampling.seed, calls))
        out = engine.generate([e.ids for e in live], 1, params)
        calls += 1
        generate_s += float(getattr(engine, "last_generate_s", 0.0))
        versions.add(int(out.policy_version))
        if len(versions) > 1:
            raise RuntimeError(f"the engines' weights changed during the episodes (policy versions {sorted(versions)}); "
                               "a step's episodes must all be sampled by one policy")
        logps = out.sampling_logp
        for row, (episode, budget) in enumerate(zip(live, budgets)):
            on = out.response_mask[row] > 0
            ids = out.input_ids[row][on].tolist()
            lps = logps[row][on].tolist()
            stopped = out.finish_reason[row] == "stop" and len(ids) <= budget
            episode.add_turn(ids[:budget], lps[:budget], stopped=stopped)
    return EpisodeRun(calls, generate_s, versions.pop() if versions else 0)


class EnvironmentFailure(RuntimeError):
    """An environment failed where no episode can go on without it (its `reset` or `reward`); names the row."""


def _where(example: Any) -> str:
    return getattr(example, "row", "") or "a row"


def rollout_episodes(engine: RolloutEngine, task: Any, examples: Sequence[Any], tokenizer, n: int,
                     sampling: SamplingParams, *, max_turns: int, max_episode_tokens: int) -> tuple[Completions, float]:
    """`n` episodes of `task.environment` per example, sampled to their ends; `(completions, seconds inside the
    engines)`. The completions carry every episode's record (`Episode.record`: conversation, the environment's
    reward, counts) in `episodes`. An environment whose `reset` or `reward` fails on a row stops the
    rollout naming the row; one whose `respond` fails ends that episode, counted in its `env_errors`."""
    environment = task.environment
    name = getattr(environment, "__name__", repr(environment))
    episodes = []
    for example in examples:
        for _ in range(n):
            try:
                episodes.append(Episode(environment(example), tokenizer, max_turns=max_turns,
                                        max_tokens=max_episode_tokens))
            except Exception as exc:
                raise EnvironmentFailure(f"{_where(example)}: the episode of {name} could not start: {type(exc).__name__}: "
                                         f"{exc}") from exc
    run = run_episodes(engine, episodes, sampling)
    records = []
    for j, episode in enumerate(episodes):
        example = examples[j // n]
        began = time.perf_counter()
        try:
            reward = float(episode.env.reward())
        except Exception as exc:
            raise EnvironmentFailure(f"{_where(example)}: {name}.reward() raised {type(exc).__name__}: {exc}") from exc
        episode.env_s += time.perf_counter() - began
        if not math.isfinite(reward):
            raise EnvironmentFailure(f"{_where(example)}: {name}.reward() returned {reward}; an "
                                     "episode's reward must be a finite number")
        records.append(episode.record(reward))
    out = episodes_to_completions(episodes, n=n, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, policy_version=run.policy_version)
    out.episodes = records
    return out, run.generate_s


def display_texts(completions: Completions, tokenizer) -> list[str]:
    """What people read of each row (the completions table, the Prefect run): the response text, or an agent
    episode's conversation after its opening messages (`conversation_text`)."""
    if completions.episodes is None:
        return completions.decode_responses(tokenizer)
    return [conversation_text(e) for e in completions.episodes]


def conversation_text(record: dict) -> str:
    """An episode's conversation after its opening messages, as text for people (the MLflow completions table, the
    Prefect run): one `role: content` block per message, tool calls as the JSON the model wrote."""
    lines = []
    for message in record["completion"]:
        text = message.get("content") or ""
        for call in message.get("tool_calls") or ():
            text += ("\n" if text else "") + "<tool_call>" + json.dumps(call["function"]) + "</tool_call>"
        lines.append(f"{message['role']}: {text}")
    return "\n".join(lines)


def episodes_to_completions(episodes: list[Episode], *, n: int, pad_token_id: int, eos_token_id: int,
                            policy_version: int) -> Completions:
    """The ended episodes as `Completions` (layout in the module docstring); episodes `i*n .. i*n+n-1` are the `n`
    episodes of prompt `i`."""
    if not episodes or len(episodes) % n or not all(e.done for e in episodes):
        raise ValueError(f"episodes_to_completions takes ended episodes, n={n} per prompt (got {len(episodes)}, "
                         f"{sum(not e.done for e in episodes)} still live)")
    P = max(e.prompt_len for e in episodes)
    R = max(1, max(len(e.ids) - e.prompt_len for e in episodes))
    rows = len(episodes)
    input_ids = torch.full((rows, P + R), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, P + R), dtype=torch.long)
    mask = torch.zeros((rows, P + R), dtype=torch.float32)
    logp = torch.zeros((rows, P + R), dtype=torch.float32)
    for j, e in enumerate(episodes):
        start = P - e.prompt_len
        end = start + len(e.ids)
        input_ids[j, start:end] = torch.tensor(e.ids, dtype=torch.long)
        attention[j, start:end] = 1
        mask[j, start:end] = torch.tensor(e.sampled, dtype=torch.float32)
        logp[j, start:end] = torch.tensor(e.logp, dtype=torch.float32)
    return Completions(
        input_ids=input_ids, attention_mask=attention, response_mask=mask, sampling_logp=logp,
        prompt_index=torch.arange(rows // n).repeat_interleave(n),
        finish_reason=["length" if e.truncated else "stop" for e in episodes],
        policy_version=policy_version, prompt_length=P, eos_token_id=eos_token_id, pad_token_id=pad_token_id, n=n,
    )


def episode_stats(records: Sequence[dict]) -> dict[str, float]:
    """A step's agent metrics from its episode records: turns and tool calls per episode, tool and environment
    errors, truncated episodes, the environment's reward and the seconds spent inside the environments."""
    n = max(len(records), 1)
    total = {key: sum(float(r["stats"][key]) for r in records)
             for key in ("turns", "tool_calls", "tool_errors", "truncated", "env_errors", "env_s")}
    return {"rollout/turns_mean": total["turns"] / n, "rollout/turns_max": max((r["stats"]["turns"] for r in records), default=0),
            "rollout/tool_calls_mean": total["tool_calls"] / n, "rollout/tool_errors": total["tool_errors"],
            "rollout/env_errors": total["env_errors"], "rollout/truncated_episodes": total["truncated"],
            "rollout/env_reward_mean": sum(float(r["reward"]) for r in records) / n, "perf/env_s": total["env_s"]}
