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
import logging
import math
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from rl_core.agents.episode import Episode
from rl_core.agents.host import LocalEnvironments
from rl_core.rollout.base import SEED_MODULUS, Completions, RolloutEngine, SamplingParams

log = logging.getLogger("posttrain.agents")


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a step seeded `seed` (unrelated streams for neighbouring turns)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (turn + 1) * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 31
    return int(x % SEED_MODULUS)


class EpisodeRun(NamedTuple):
    calls: int  # engine calls: the most turns of any episode
    generate_s: float  # seconds inside the engines' generate, summed over the calls
    policy_version: int  # the one policy version every call sampled with


def run_episodes(engine: RolloutEngine, episodes: list[Episode], sampling: SamplingParams,
                 host: Any = None, keys: Sequence[Hashable] | None = None) -> EpisodeRun:
    """Sample every episode to its end (`sampling.max_tokens`: per turn), checking that every engine call sampled
    with one policy version. The environments answer each call's turns in one batch: `host`'s (`keys[j]` is
    episode j's there, `rl_core.agents.host`), or, without a host, each episode's own (`Episode.add_turn`)."""
    calls, generate_s, versions = 0, 0.0, set()
    while live := [j for j, e in enumerate(episodes) if not e.done]:
        budgets = [episodes[j].turn_budget(sampling.max_tokens) for j in live]
        if min(budgets) < 1:
            raise RuntimeError("a live episode has no token left for its next turn")  # Episode ends it before
        params = replace(sampling, max_tokens=max(budgets),
                         seed=None if sampling.seed is None else turn_seed(sampling.seed, calls))
        out = engine.generate([episodes[j].ids for j in live], 1, params)
        calls += 1
        generate_s += float(getattr(engine, "last_generate_s", 0.0))
        versions.add(int(out.policy_version))
        if len(versions) > 1:
            raise RuntimeError(f"the engines' weights changed during the episodes (policy versions {sorted(versions)}); "
                               "a step's episodes must all be sampled by one policy")
        logps = out.sampling_logp
        waiting = []
        for row, (j, budget) in enumerate(zip(live, budgets)):
            on = out.response_mask[row] > 0
            ids = out.input_ids[row][on].tolist()
            lps = logps[row][on].tolist()
            stopped = out.finish_reason[row] == "stop" and len(ids) <= budget
            if host is None:
                episodes[j].add_turn(ids[:budget], lps[:budget], stopped=stopped)
            elif (turn := episodes[j].take_turn(ids[:budget], lps[:budget], stopped=stopped)) is not None:
                waiting.append((j, turn))
        if waiting:
            answers = host.respond([(keys[j], turn) for j, turn in waiting])
            for (j, _), answer in zip(waiting, answers, strict=True):
                episodes[j].answer(answer)
    return EpisodeRun(calls, generate_s, versions.pop() if versions else 0)


class EnvironmentFailure(RuntimeError):
    """An environment failed where no episode can go on without it (its `reset` or `reward`); names the row."""


def _where(example: Any) -> str:
    return getattr(example, "row", "") or "a row"


def rollout_episodes(engine: RolloutEngine, task: Any, examples: Sequence[Any], tokenizer, n: int,
                     sampling: SamplingParams, *, max_turns: int, max_episode_tokens: int,
                     host: Any = None) -> tuple[Completions, float]:
    """`n` episodes of `task.environment` per example, sampled to their ends; `(completions, seconds inside the
    engines)`. The environments live in `host` (`infra.workers.environments.EnvironmentPool`: Ray actors, with timeouts),
    or in this process (`LocalEnvironments`). The completions carry every episode's record (`Episode.record`:
    conversation, the environment's reward, counts) in `episodes`.

    An episode that cannot start (its environment's construction or `reset` fails, or its opening prompt does not
    fit `max_episode_tokens`) leaves its row out of the step: the row's `n` episodes end unstarted
    (`Episode.unstarted`: no loss token, reward 0, `rollout/unstarted_episodes`), a warning names the row, and the
    other rows play on; only a step where no row can start stops, naming them. An environment that fails to score
    (`reward`) stops the rollout naming the row; one whose `respond` fails ends that episode, counted in its
    `env_errors`; one lost to a timeout (its own or another episode's on the same actor) ends its episode with
    reward 0, counted the same way."""
    environment = task.environment
    host = LocalEnvironments() if host is None else host
    batch = uuid.uuid4().hex  # the keys of this rollout's episodes, apart from any other rollout's on the host
    keys = [f"{batch}:{j}" for j in range(len(examples) * n)]
    try:
        openings = host.open(environment, [(key, examples[j // n]) for j, key in enumerate(keys)])
        episodes, failed = _start(openings, tokenizer, n, max_turns, max_episode_tokens)
        if len(failed) == len(examples):
            raise EnvironmentFailure("no episode of this step could start: " + "; ".join(
                f"{_where(examples[i])}: {why}" for i, why in list(failed.items())[:3]))
        for i, why in failed.items():
            log.warning("%s: %s; its %d episode(s) are left out of this step", _where(examples[i]), why, n)
        host.discard([keys[j] for j in range(len(keys)) if j // n in failed])
        started = [j for j in range(len(keys)) if j // n not in failed]
        run = run_episodes(engine, [episodes[j] for j in started], sampling, host, [keys[j] for j in started])
        answers = dict(zip(started, host.finish([keys[j] for j in started]), strict=True))
    except BaseException:
        host.discard(keys)
        raise
    records = []
    for j, episode in enumerate(episodes):
        if j not in answers:
            records.append(episode.record(0.0))
            continue
        answer = answers[j]
        episode.env_s += answer.seconds
        reward = answer.reward
        if answer.lost:
            reward, episode.env_error = 0.0, episode.env_error or answer.error
        elif answer.error is not None:
            raise EnvironmentFailure(f"{_where(examples[j // n])}: {answer.error}")
        else:
            episode.tool_calls, episode.tool_errors = answer.tool_calls, answer.tool_errors
        if reward is None or not math.isfinite(reward):
            raise EnvironmentFailure(f"{_where(examples[j // n])}: {environment.__name__}.reward() returned {reward}; "
                                     "an episode's reward must be a finite number")
        records.append(episode.record(reward))
    out = episodes_to_completions(episodes, n=n, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, policy_version=run.policy_version)
    out.episodes = records
    return out, run.generate_s


def _start(openings: Sequence[Any], tokenizer, n: int, max_turns: int,
           max_tokens: int) -> tuple[list[Episode], dict[int, str]]:
    """Each opening's episode, and `{row: why}` for the rows with an episode that could not start: all `n` episodes
    of such a row end unstarted (a group with a missing episode would skew its advantages)."""
    episodes: list[Episode | None] = []
    failed: dict[int, str] = {}
    for j, opening in enumerate(openings):
        error = opening.error
        if error is None:
            try:
                episodes.append(Episode(opening, tokenizer, max_turns=max_turns, max_tokens=max_tokens))
                continue
            except ValueError as exc:
                error = str(exc)
        episodes.append(None)
        failed.setdefault(j // n, f"the episode could not start: {error}")
    return [Episode.unstarted(tokenizer, failed[j // n], openings[j].seconds) if j // n in failed else e
            for j, e in enumerate(episodes)], failed


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
    errors, truncated episodes, replies that did not fit their episode's budget, the environment's reward and the
    seconds spent inside the environments."""
    n = max(len(records), 1)
    total = {key: sum(float(r["stats"][key]) for r in records)
             for key in ("turns", "tool_calls", "tool_errors", "truncated", "env_errors", "env_s")}
    return {"rollout/unstarted_episodes": float(sum(not r["stats"].get("started", True) for r in records)),
            "rollout/turns_mean": total["turns"] / n, "rollout/turns_max": max((r["stats"]["turns"] for r in records), default=0),
            "rollout/tool_calls_mean": total["tool_calls"] / n, "rollout/tool_errors": total["tool_errors"],
            "rollout/env_errors": total["env_errors"], "rollout/truncated_episodes": total["truncated"],
            "rollout/oversized_replies": float(sum(r["stats"].get("oversized_replies", 0) for r in records)),
            "rollout/env_reward_mean": sum(float(r["reward"]) for r in records) / n, "perf/env_s": total["env_s"]}
