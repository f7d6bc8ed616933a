"""Episode scheduling (rl_core.agents.scheduling): per episode and lock-step sample the same episodes; a slow
environment call holds back only its own episode (shown by the order of events, not by timing); an episode stays on
the engine it started on, and episodes are dealt to the least loaded engine. In-process HF engines, the tiny
character tokenizer; no Ray."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from rl_core.agents import Environment, Reply
from rl_core.agents.rollout import rollout_episodes
from rl_core.agents.scheduling import episode_seed, turn_seed
from rl_core.rollout import HFEngine, SamplingParams
from rl_core.rollout.seeds import completion_seeds
from rl_core.tasks import Example
from rl_core.tasks.environment import EnvironmentTask
from tests.rl_core.test_agents import Nag, stopping_policy, tokenizer

ROWS = [Example("1+1?", "2"), Example("what is 7+8?", "15"), Example("9?", "9")]


def rollout(engine, tok, environment, rows, n, scheduling, **sampling):
    task = EnvironmentTask(environment, f"tests.rl_core.test_scheduling:{environment.__name__}")
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 6, "seed": 5, **sampling})
    return rollout_episodes(engine, task, rows, tok, n, params, max_turns=4, max_episode_tokens=200,
                            scheduling=scheduling)[0]


def test_an_episodes_turn_seed_mixes_the_draw_the_episode_and_the_turn():
    """episode_seed(seed, j, t) is completion_seeds' seed of row j under turn t's seed: a pure function of the three."""
    assert episode_seed(5, 3, 2) == completion_seeds(turn_seed(5, 2), 3, 1, 1)[0]
    seeds = {episode_seed(5, j, t) for j in range(20) for t in range(6)}
    assert len(seeds) == 120 and all(0 <= s < 2**63 for s in seeds)


def test_per_episode_and_lock_step_sample_the_same_episodes():
    """Nine episodes of uneven length (the stopping policy ends some turns early and cuts others), float32 HF: both
    schedules give the same token ids and masks, and log-probs that agree to float rounding (the rows share engine
    calls with other rows under each)."""
    tok = tokenizer()
    engine = HFEngine(stopping_policy(tok), tok)
    lock = rollout(engine, tok, Nag, ROWS, 3, "lock_step")
    free = rollout(engine, tok, Nag, ROWS, 3, "per_episode")
    turns = [e["stats"]["turns"] for e in lock.episodes]
    assert len(set(turns)) > 1 and max(turns) >= 2, turns  # uneven episodes: the batches differ between schedules
    assert [e["stats"]["turns"] for e in free.episodes] == turns
    assert torch.equal(lock.input_ids, free.input_ids) and torch.equal(lock.response_mask, free.response_mask)
    assert (lock.sampling_logp - free.sampling_logp).abs().max().item() <= 1e-5
    assert lock.finish_reason == free.finish_reason
    other = rollout(engine, tok, Nag, ROWS, 3, "per_episode", seed=6)
    assert not torch.equal(other.input_ids[:, other.prompt_length:], free.input_ids[:, free.prompt_length:])


class Waits(Environment):
    """Row 'slow': its first answer waits until every other episode has ended (at most `timeout` s). Every episode ends
    at its third turn, the others answering at once. `log` records the order of events."""

    log: ClassVar[list[str]] = []
    others = 0
    timeout = 0.0
    ended = 0
    everyone_else_ended = threading.Event()
    lock = threading.Lock()

    @classmethod
    def reset_shared(cls, others: int, timeout: float) -> list[str]:
        cls.log, cls.others, cls.timeout, cls.ended = [], others, timeout, 0
        cls.everyone_else_ended = threading.Event()
        return cls.log

    def respond(self, turn):
        self.count = getattr(self, "count", 0) + 1
        cls = type(self)
        if self.example.prompt == "slow" and self.count == 1:
            cls.log.append("slow waits")
            released = cls.everyone_else_ended.wait(cls.timeout)
            cls.log.append(f"slow answers (released={released})")
            return Reply([{"role": "user", "content": "and?"}])
        if self.count < 3:
            return Reply([{"role": "user", "content": "and?"}])
        if self.example.prompt == "slow":
            cls.log.append("slow ends")
            return Reply(done=True)
        with cls.lock:
            cls.ended += 1
            cls.log.append("other ends")
            if cls.ended == cls.others:
                cls.everyone_else_ended.set()
        return Reply(done=True)

    def reward(self):
        return 0.0


def always_stops(tok):
    """The stopping policy with its <eos> logit raised by 100: every turn is the one token <eos>, stopped."""
    model = stopping_policy(tok)

    def lift(module, args, out):
        out[..., tok.eos_token_id] += 100.0
        return out

    model.lm_head.register_forward_hook(lift)
    return model


@pytest.mark.parametrize("scheduling", ["per_episode", "lock_step"])
def test_a_slow_environment_call_holds_back_only_its_own_episode(scheduling):
    """Per episode, the five other episodes play all their turns and end while the slow episode's first answer waits:
    its wait is released by their ends. In lock-step they cannot move until it answers: its wait runs out."""
    tok = tokenizer()
    engine = HFEngine(always_stops(tok), tok)
    rows = [Example("slow", "0")] + [Example(f"fast {i}", "0") for i in range(5)]
    log = Waits.reset_shared(others=5, timeout=30.0 if scheduling == "per_episode" else 0.5)
    out = rollout(engine, tok, Waits, rows, 1, scheduling)
    if scheduling == "per_episode":
        assert log == ["slow waits"] + ["other ends"] * 5 + ["slow answers (released=True)", "slow ends"], log
    else:
        assert log[:2] == ["slow waits", "slow answers (released=False)"], log
    assert [e["stats"]["turns"] for e in out.episodes] == [3] * 6


class Recording:
    """An HF engine that records the first id after the opening prompt of every row it is asked for."""

    def __init__(self, engine, calls: list):
        self.engine, self.calls = engine, calls

    def generate(self, prompt_ids, n, sampling, prompt_offset=0):
        self.calls.append([tuple(p) for p in prompt_ids])
        out = self.engine.generate(prompt_ids, n, sampling, prompt_offset)
        self.last_generate_s = self.engine.last_generate_s
        return out


class TwoEngines:
    """Two lanes (as `infra.workers.engines.EnginePool.lanes` gives them), over one HF model."""

    def __init__(self, engine):
        self.calls: tuple[list, list] = ([], [])
        self.engines = [Recording(engine, self.calls[0]), Recording(engine, self.calls[1])]

    def lanes(self):
        return self.engines


def test_an_episode_stays_on_its_engine_and_episodes_are_dealt_to_the_least_loaded():
    """Six episodes (six different openings) over two engines: three on each, and every turn of an episode goes to the
    engine of its first turn (its context starts with its opening). The same episodes as one engine gives."""
    tok = tokenizer()
    model = stopping_policy(tok)
    pair = TwoEngines(HFEngine(model, tok))
    rows = [Example(f"{i}+{i}?", str(2 * i)) for i in range(6)]
    two = rollout(pair, tok, Nag, rows, 1, "per_episode")
    one = rollout(HFEngine(model, tok), tok, Nag, rows, 1, "per_episode")
    assert torch.equal(two.input_ids, one.input_ids)
    openings = [set(calls[0]) for calls in pair.calls]  # each engine's first call: the openings of its episodes
    assert [len(o) for o in openings] == [3, 3] and not openings[0] & openings[1]
    assert max(len(calls) for calls in pair.calls) >= 2  # later turns
    for e, calls in enumerate(pair.calls):
        for context in (c for call in calls for c in call):
            assert any(context[:len(o)] == o for o in openings[e]), (e, context)
