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

from dataclasses import replace

import torch

from rl_core.agents.episode import Episode
from rl_core.rollout.base import SEED_MODULUS, Completions, RolloutEngine, SamplingParams


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a step seeded `seed` (unrelated streams for neighbouring turns)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (turn + 1) * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 31
    return int(x % SEED_MODULUS)


def run_episodes(engine: RolloutEngine, episodes: list[Episode], sampling: SamplingParams) -> int:
    """Sample every episode to its end (`sampling.max_tokens`: per turn); returns the number of engine calls."""
    calls = 0
    while live := [e for e in episodes if not e.done]:
        budgets = [e.turn_budget(sampling.max_tokens) for e in live]
        if min(budgets) < 1:
            raise RuntimeError("a live episode has no token left for its next turn")  # Episode ends it before
        params = replace(sampling, max_tokens=max(budgets),
                         seed=None if sampling.seed is None else turn_seed(sampling.seed, calls))
        out = engine.generate([e.ids for e in live], 1, params)
        calls += 1
        logps = out.sampling_logp
        for row, (episode, budget) in enumerate(zip(live, budgets)):
            on = out.response_mask[row] > 0
            ids = out.input_ids[row][on].tolist()
            lps = logps[row][on].tolist()
            stopped = out.finish_reason[row] == "stop" and len(ids) <= budget
            episode.add_turn(ids[:budget], lps[:budget], stopped=stopped)
    return calls


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
