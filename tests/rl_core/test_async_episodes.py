"""Agent episodes across a weight sync (rl.async_steps): every sampled token keeps the policy version that sampled it,
its sampling log-prob is that version's (float32 HF, to 1e-5), the batch's version is its oldest token's, and the
rollout correction's weights on such a batch (mixed versions, holes where the environment's tokens are) are the
closed forms. In-process HF engine, the tiny character tokenizer; no Ray."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl_core.agents.rollout import rollout_episodes
from rl_core.primitives.logprobs import sequence_token_logprobs
from rl_core.primitives.rollout_correction import rollout_correction_weights
from rl_core.rollout import HFEngine, SamplingParams
from rl_core.tasks import Example
from rl_core.tasks.environment import EnvironmentTask
from tests.rl_core.test_agents import Nag, stopping_policy, tokenizer

ROWS = [Example("1+1?", "2"), Example("what is 7+8?", "15"), Example("9?", "9")]


class SyncAfter:
    """An HF engine whose weights become `new` (policy version 1) right after its `after`-th call, as a weight sync
    of `rl.async_steps` lands between two engine calls."""

    def __init__(self, engine: HFEngine, after: int, new: dict):
        self.engine, self.after, self.new, self.calls = engine, after, new, 0

    def generate(self, prompt_ids, n, sampling, prompt_offset=0):
        out = self.engine.generate(prompt_ids, n, sampling, prompt_offset)
        self.last_generate_s = self.engine.last_generate_s
        self.calls += 1
        if self.calls == self.after:
            self.engine.update_weights(self.new, version=1)
        return out


def models(tok):
    old = stopping_policy(tok)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return old, new


def episodes(engine, tok, **kwargs):
    task = EnvironmentTask(Nag, "tests.rl_core.test_agents:Nag")
    return rollout_episodes(engine, task, ROWS, tok, 3, SamplingParams(temperature=1.0, max_tokens=6, seed=5),
                            max_turns=4, max_episode_tokens=200, **kwargs)[0]


def logprobs(model, c):
    with torch.no_grad():
        return sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0, loss_mask=c.response_mask)


@pytest.mark.parametrize("scheduling", ["per_episode", "lock_step"])
def test_tokens_keep_the_version_that_sampled_them_across_a_sync_between_turns(scheduling):
    tok = tokenizer()
    old, new = models(tok)
    engine = SyncAfter(HFEngine(copy.deepcopy(old), tok), after=2, new=new.state_dict())
    c = episodes(engine, tok, scheduling=scheduling, mixed_versions=True)
    sampled = c.response_mask > 0
    assert c.token_version is not None
    versions = c.token_version[sampled]
    assert set(versions.tolist()) == {0, 1} and c.policy_version == 0
    assert int(c.token_version[~sampled].abs().sum()) == 0
    for row in range(len(c)):  # within an episode the versions only move forward
        v = c.token_version[row][sampled[row]].tolist()
        assert v == sorted(v)
    assert any(len(set(c.token_version[r][sampled[r]].tolist())) == 2 for r in range(len(c)))  # an episode across it
    # each token's sampling log-prob is the log-prob of the version that sampled it
    by_version = {0: logprobs(old, c), 1: logprobs(new, c)}
    for version, trainer in by_version.items():
        here = sampled & (c.token_version == version)
        assert (c.sampling_logp - trainer)[here].abs().max().item() <= 1e-5
    moved = sampled & (c.token_version == 1)
    assert (c.sampling_logp - by_version[0])[moved].abs().max().item() > 1e-3  # the sync changed the policy
    mean_lag, max_lag = c.staleness(1)
    assert max_lag == 1 and mean_lag == pytest.approx(float((versions == 0).float().mean()))


def test_without_mixed_versions_a_sync_during_the_episodes_stops_the_rollout():
    tok = tokenizer()
    old, new = models(tok)
    engine = SyncAfter(HFEngine(copy.deepcopy(old), tok), after=2, new=new.state_dict())
    with pytest.raises(RuntimeError, match=r"weights changed during the episodes \(policy versions \[0, 1\]\)"):
        episodes(engine, tok)


@pytest.mark.parametrize(("mode", "level"), [("tis", "token"), ("mis", "token"), ("tis", "sequence"),
                                             ("mis", "sequence")])
def test_rollout_correction_on_a_mixed_version_batch_with_holes_is_the_closed_form(mode, level):
    """π_old of the trainer (the newer weights) against the sampler's log-probs of a batch sampled across a sync:
    token ρ = exp(ℓ_old − ℓ_rollout) on sampled tokens, a row's sequence ρ the exp of the sum over its sampled tokens
    only (the environment's tokens are holes); tis min(ρ, C), mis ρ within [1/C, C] else 0; 0 on every hole."""
    tok = tokenizer()
    old, new = models(tok)
    c = episodes(SyncAfter(HFEngine(copy.deepcopy(old), tok), after=2, new=new.state_dict()), tok,
                 mixed_versions=True)
    trainer = logprobs(new, c)
    cap = 1.5
    weights, _ = rollout_correction_weights(trainer, c.sampling_logp, c.response_mask, mode=mode, level=level, cap=cap)
    holes = 0
    for r in range(len(c)):
        on = [t for t in range(c.input_ids.shape[1]) if c.response_mask[r, t] > 0]
        holes += sum(1 for t in range(c.prompt_length, c.input_ids.shape[1])
                     if c.attention_mask[r, t] > 0 and c.response_mask[r, t] == 0)
        seq = math.exp(sum(float(trainer[r, t]) - float(c.sampling_logp[r, t]) for t in on))
        for t in range(c.input_ids.shape[1]):
            if t not in on:
                assert float(weights[r, t]) == 0.0
                continue
            rho = seq if level == "sequence" else math.exp(float(trainer[r, t]) - float(c.sampling_logp[r, t]))
            want = min(rho, cap) if mode == "tis" else (rho if 1 / cap <= rho <= cap else 0.0)
            assert float(weights[r, t]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert holes > 0  # the environment's replies sit between sampled turns


def test_a_sync_inside_a_turn_gives_the_turns_later_tokens_the_new_version():
    """rollout.in_flight_updates on agent episodes: the load is asked for during the second decoding forward of the
    second engine call (every live episode's turn 2, lock-step), so each turn 2 has its first three tokens from
    version 0 and the rest from version 1, turn 1 is version 0 throughout. The new weights zero the final norm: a
    token sampled after the load has log-prob -log(V) exactly, whatever KV cache the older weights left; a version-0
    token has the old model's log-prob."""
    import threading
    import time

    tok = tokenizer()
    old = stopping_policy(tok)
    model = copy.deepcopy(old)
    engine = HFEngine(model, tok)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["model.norm.weight"].zero_()
    calls, decodes, loader = [0], [0], []
    generate = engine.generate

    def counted(*args, **kwargs):
        calls[0], decodes[0] = calls[0] + 1, 0
        return generate(*args, **kwargs)

    def during_forward(_module, _args, kwargs):
        if calls[0] != 2 or kwargs["input_ids"].shape[1] != 1:
            return
        decodes[0] += 1
        if decodes[0] == 2:  # the forward behind position 2's logits
            loader.append(threading.Thread(target=engine.update_weights, args=(new, 1)))
            loader[0].start()
            while not engine.swap.load_waiting:
                time.sleep(0.001)

    engine.generate = counted
    hook = model.register_forward_pre_hook(during_forward, with_kwargs=True)
    try:
        c = episodes(engine, tok, scheduling="lock_step", mixed_versions=True)
    finally:
        hook.remove()
        for t in loader:
            t.join()
    assert engine.policy_version == 1 and c.policy_version == 0 and loader
    sampled = c.response_mask > 0
    split_turns = 0
    for r in range(len(c)):
        on = sampled[r].nonzero().flatten().tolist()
        turns = [[on[0]]] if on else []
        for t in on[1:]:
            (turns[-1].append(t) if t == turns[-1][-1] + 1 else turns.append([t]))
        versions = [c.token_version[r, turn].tolist() for turn in turns]
        assert versions[0] == [0] * len(versions[0])  # turn 1: before the load
        if len(versions) > 1:
            assert versions[1] == [int(k >= 3) for k in range(len(versions[1]))]
            split_turns += len(versions[1]) > 3
        assert all(v == [1] * len(v) for v in versions[2:])
    assert split_turns > 0, "no turn 2 decoded past the load"
    vocab = model.get_output_embeddings().weight.shape[0]
    after, before = sampled & (c.token_version == 1), sampled & (c.token_version == 0)
    assert torch.allclose(c.sampling_logp[after], torch.full_like(c.sampling_logp[after], -math.log(vocab)), atol=1e-5)
    assert (c.sampling_logp - logprobs(old, c))[before].abs().max().item() <= 1e-5
