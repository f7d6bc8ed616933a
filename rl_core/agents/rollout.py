"""Episodes on the rollout engines, until all have ended; then they become `Completions` whose response mask has holes
where the environment's tokens are.

Each turn of an episode is a `generate` row over its token ids (no text, no chat template: the contexts are
`Episode.ids`), scheduled per episode or in lock-step (`rl_core.agents.scheduling`, `rollout.episode_scheduling`),
and seeded by the step's seed, the episode's place among the episodes that started and the turn (`episode_seed`): a
rollout repeats exactly for the same episodes, seed and weights.

Layout of the result (`episodes_to_completions`), `P` the longest opening prompt, `R` the longest rest:

    input_ids       the opening prompt left-padded to P, then the turns and the environment's deltas
    attention_mask  1 on every real token (the environment's included: the policy reads them)
    response_mask   1 on sampled tokens only (`Episode.sampled`): 0 on the environment's tokens
    sampling_logp   the sampler's log-prob of each sampled token, 0 elsewhere
    finish_reason   'stop' for an episode the environment ended, 'length' for a truncated one
    token_version   the policy version that sampled each token (0 elsewhere), when more than one did: a weight
                    sync between two engine calls of an episode (`rl.async_steps`), or inside one
                    (`rollout.in_flight_updates`)
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from rl_core.agents.episode import Episode, Sample
from rl_core.agents.host import LocalEnvironments
from rl_core.agents.scheduling import run_episodes
from rl_core.rollout.base import Completions, RolloutEngine, SamplingParams

log = logging.getLogger("posttrain.agents")


class EnvironmentFailure(RuntimeError):
    """An environment failed where no episode can go on without it (its `reset` or `reward`); names the row.
    `retryable` is False for a bug in its code (`rl_core.user_code.is_bug`): the phase's task is not retried."""

    def __init__(self, message: str, *, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


def _where(example: Any) -> str:
    return getattr(example, "row", "") or "a row"


def rollout_episodes(engine: RolloutEngine, task: Any, examples: Sequence[Any], tokenizer, n: int,
                     sampling: SamplingParams, *, max_turns: int, max_episode_tokens: int,
                     host: Any = None, scheduling: str = "per_episode",
                     mixed_versions: bool = False) -> tuple[Completions, float]:
    """`n` episodes of `task.environment` per example, sampled to their ends; `(completions, seconds inside the
    engines)`. The environments live in `host` (`infra.workers.environments.EnvironmentPool`: Ray actors, with timeouts),
    or in this process (`LocalEnvironments`). The completions carry every episode's record (`Episode.record`:
    conversation, the environment's reward, counts) in `episodes`. `scheduling`: `rollout.episode_scheduling`
    (`rl_core.agents.scheduling`); `mixed_versions`: a weight sync may land during the rollout (`rl.async_steps`),
    and each token keeps the version that sampled it (else the rollout stops if the weights change).

    An episode that cannot start (its environment's construction or `reset` fails, or its opening prompt does not
    fit `max_episode_tokens`) leaves its row out of the step: the row's `n` episodes end unstarted
    (`Episode.unstarted`: no loss token, reward 0, `rollout/unstarted_episodes`), a warning names the row, and the
    other rows play on; only a step where no row can start stops, naming them (not retryable when no row failed
    for a reason a retry may not meet: `Opening.retryable`). An environment that fails to score
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
        if len(failed) == len(examples):  # retried only where some row failed for a reason a retry may not meet
            raise EnvironmentFailure("no episode of this step could start: " + "; ".join(
                f"{_where(examples[i])}: {why}" for i, why in list(failed.items())[:3]),
                retryable=any(o.retryable for o in openings if o.error is not None))
        for i, why in failed.items():
            log.warning("%s: %s; its %d episode(s) are left out of this step", _where(examples[i]), why, n)
        host.discard([keys[j] for j in range(len(keys)) if j // n in failed])
        started = [j for j in range(len(keys)) if j // n not in failed]
        run = run_episodes(engine, [episodes[j] for j in started], sampling, host, [keys[j] for j in started],
                           schedule=scheduling, mixed_versions=mixed_versions)
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
            raise EnvironmentFailure(f"{_where(examples[j // n])}: {answer.error}", retryable=answer.retryable)
        else:
            episode.tool_calls, episode.tool_errors = answer.tool_calls, answer.tool_errors
            episode.refused_requests = answer.refused
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
    Prefect run): one `role: content` block per message, tool calls as JSON; an assistant turn with a call that did
    not parse as the model wrote it, every call in it included (`malformed_turns`)."""
    lines, malformed, turn = [], record.get("malformed_turns") or [], 0
    for message in record["completion"]:
        text = message.get("content") or ""
        for call in message.get("tool_calls") or ():
            text += ("\n" if text else "") + "<tool_call>" + json.dumps(call["function"]) + "</tool_call>"
        if message["role"] == "assistant":
            if turn < len(malformed) and malformed[turn] is not None:
                text = malformed[turn]
            turn += 1
        lines.append(f"{message['role']}: {text}")
    return "\n".join(lines)


def episodes_to_completions(episodes: list[Episode], *, n: int, pad_token_id: int, eos_token_id: int,
                            policy_version: int) -> Completions:
    """The ended episodes as `Completions` (layout in the module docstring); episodes `i*n .. i*n+n-1` are the `n`
    episodes of prompt `i`, each row its episode's last sample, and the samples before it (`Episode.earlier`) in
    `earlier_samples`, each pointing at its episode's row. Its `policy_version` is the oldest that sampled a token
    (`Episode.versions`; `policy_version` when none was sampled), and `token_version` each token's, when they
    differ."""
    if not episodes or len(episodes) % n or not all(e.done for e in episodes):
        raise ValueError(f"episodes_to_completions takes ended episodes, n={n} per prompt (got {len(episodes)}, "
                         f"{sum(not e.done for e in episodes)} still live)")
    last = _laid_out([e.samples[-1] for e in episodes], pad_token_id)
    owners = [j for j, e in enumerate(episodes) for _ in e.earlier]
    earlier = _laid_out([s for e in episodes for s in e.earlier], pad_token_id) if owners else None
    sampled = torch.cat([t["version"][t["mask"] > 0] for t in (last, earlier) if t is not None])
    mixed = sampled.numel() > 0 and int(sampled.min()) != int(sampled.max())
    rewarded = any(r for e in episodes for s in e.samples for r in s.rewards)  # some turn has a reward of its own
    if sampled.numel():
        policy_version = int(sampled.min())  # the oldest that sampled a token (Completions.policy_version)

    def completions(t: dict, prompt_index: torch.Tensor, finish_reason: list[str]) -> Completions:
        return Completions(
            input_ids=t["ids"], attention_mask=t["attention"], response_mask=t["mask"], sampling_logp=t["logp"],
            prompt_index=prompt_index, finish_reason=finish_reason, policy_version=policy_version,
            prompt_length=t["P"], eos_token_id=eos_token_id, pad_token_id=pad_token_id, n=n,
            token_version=t["version"] if mixed else None, turn_rewards=t["rewards"] if rewarded else None)

    out = completions(last, torch.arange(len(episodes) // n).repeat_interleave(n),
                      ["length" if e.truncated else "stop" for e in episodes])
    if earlier is not None:  # an earlier sample ended where its episode went on in a new one: never cut
        out.earlier_samples = completions(earlier, torch.tensor(owners, dtype=torch.long), ["stop"] * len(owners))
    return out


def _laid_out(samples: list[Sample], pad_token_id: int) -> dict[str, Any]:
    """Samples as the rows of `[rows, P + R]` tensors: prompts left-padded to the longest, `P`."""
    P = max(s.prompt_len for s in samples)
    R = max(1, max(len(s.ids) - s.prompt_len for s in samples))
    shape = (len(samples), P + R)
    t = {"ids": torch.full(shape, pad_token_id, dtype=torch.long), "attention": torch.zeros(shape, dtype=torch.long),
         "mask": torch.zeros(shape, dtype=torch.float32), "logp": torch.zeros(shape, dtype=torch.float32),
         "version": torch.zeros(shape, dtype=torch.long), "rewards": torch.zeros(shape, dtype=torch.float32), "P": P}
    for j, s in enumerate(samples):
        start = P - s.prompt_len
        end = start + len(s.ids)
        t["ids"][j, start:end] = torch.tensor(s.ids, dtype=torch.long)
        t["attention"][j, start:end] = 1
        t["mask"][j, start:end] = torch.tensor(s.sampled, dtype=torch.float32)
        t["logp"][j, start:end] = torch.tensor(s.logp, dtype=torch.float32)
        t["version"][j, start:end] = torch.tensor(s.versions, dtype=torch.long)
        t["rewards"][j, start:end] = torch.tensor(s.rewards, dtype=torch.float32)
    return t


# The limits that cut an episode short (`Episode.cut_by`), each with the config key that sets it (None: a turn's own
# cap, from its environment's Reply or Opening or an agent request's max_tokens) and what it means.
CUT_LIMITS = {
    "max_turns": ("rollout.max_turns", ("its environment had not ended it by then; raise it, or end episodes with "
                                       "Reply(done=True)")),
    "max_tokens": ("rollout.max_tokens", ("a turn ran out of tokens before its stop token; raise it, or warm-start "
                                         "the model on shorter turns")),
    "max_episode_tokens": ("rollout.max_episode_tokens", ("the conversation (prompt, turns, replies) filled the "
                                                         "episode's budget; raise it, or keep replies short")),
    "turn_cap": (None, ("a turn reached its own cap (its environment's Reply.max_tokens or Opening.max_tokens, or "
                       "an agent request's max_tokens)")),
}


def truncation_warning(stats: dict, rollout: Any) -> tuple[str, str] | None:
    """`(limit, message)` when most of a step's episodes (`episode_stats`) were cut by a limit, naming the limit
    that cut most of them and its value in `rollout` (the config's section); else None. An environment's errors
    are counted apart (`rollout/env_errors`)."""
    n = stats.get("rollout/episodes", 0.0)
    cut = {limit: stats.get(f"rollout/cut_by_{limit}", 0.0) for limit in CUT_LIMITS}
    total = sum(cut.values())
    if not n or 2 * total <= n:
        return None
    limit = max(cut, key=cut.__getitem__)
    key, why = CUT_LIMITS[limit]
    name = f"{key}={getattr(rollout, key.split('.', 1)[1])}" if key else "a turn's own cap"
    return limit, (f"{int(total)} of {int(n)} episodes of this step were cut short by a limit, {int(cut[limit])} by "
                   f"{name}: {why}")


def episode_stats(records: Sequence[dict]) -> dict[str, float]:
    """A step's agent metrics from its episode records: turns and tool calls per episode, tool and environment
    errors, truncated episodes and the limit that cut each, replies that did not fit their episode's budget, an
    agent function's requests the gateway refused, the environment's reward and the seconds spent inside the
    environments."""
    n = max(len(records), 1)
    total = {key: sum(float(r["stats"][key]) for r in records)
             for key in ("turns", "tool_calls", "tool_errors", "truncated", "env_errors", "env_s")}
    return {"rollout/unstarted_episodes": float(sum(not r["stats"].get("started", True) for r in records)),
            "rollout/turns_mean": total["turns"] / n, "rollout/turns_max": max((r["stats"]["turns"] for r in records), default=0),
            "rollout/tool_calls_mean": total["tool_calls"] / n, "rollout/tool_errors": total["tool_errors"],
            "rollout/env_errors": total["env_errors"], "rollout/truncated_episodes": total["truncated"],
            "rollout/oversized_replies": float(sum(r["stats"].get("oversized_replies", 0) for r in records)),
            "rollout/refused_requests": float(sum(r["stats"].get("refused_requests", 0) for r in records)),
            "rollout/env_reward_mean": sum(float(r["reward"]) for r in records) / n, "perf/env_s": total["env_s"],
            "rollout/episodes": float(len(records)),
            # samples an episode started where its conversation did not extend the last (rl_core.agents.episode)
            "rollout/new_samples": float(sum(r["stats"].get("samples", 1) - 1 for r in records)),
            **{f"rollout/cut_by_{limit}": float(sum(r["stats"].get("cut_by") == limit for r in records))
               for limit in CUT_LIMITS}}
