"""Which limit cut an episode short (`Episode.cut_by`), counted per step, and the warning when most of a step's
episodes were cut: it names the limit that cut most of them and its configured value."""

from __future__ import annotations

from rl_core.agents import Environment, Episode, Reply
from rl_core.agents.rollout import episode_stats, truncation_warning
from rl_core.config import PosttrainConfig
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.tasks import Example
from tests.rl_core.test_agents import HERMES, sample


class Chatty(Environment):
    """Never ends an episode; its first turn is capped at 3 tokens when `cap` is in the row's answer."""

    def reset(self):
        if self.example.answer == "cap":
            self.first_turn_max_tokens = 3
        return super().reset()

    def respond(self, turn) -> Reply:
        return Reply([{"role": "user", "content": "go on"}])

    def reward(self) -> float:
        return 0.0


def tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = HERMES
    return tok


def test_each_limit_is_named_where_it_cut_and_the_step_warns_when_most_episodes_were_cut():
    tok = tokenizer()
    turns = Episode(Chatty(Example("hi", "")), tok, max_turns=2, max_tokens=400)
    sample(turns, "a")
    sample(turns, "b")
    budget = Episode(Chatty(Example("hi", "")), tok, max_turns=9, max_tokens=400)
    room = budget.turn_budget(10_000)
    sample(budget, "x" * room, stop=False)  # the turn filled what was left of the episode
    long_turn = Episode(Chatty(Example("hi", "")), tok, max_turns=9, max_tokens=400)
    sample(long_turn, "abc", stop=False)  # stopped by the per-turn budget, far below the episode's
    capped = Episode(Chatty(Example("hi", "cap")), tok, max_turns=9, max_tokens=400)
    assert capped.turn_budget(96) == 3
    sample(capped, "abc", stop=False)
    ended = Episode(Chatty(Example("hi", "")), tok, max_turns=9, max_tokens=400)
    assert [e.cut_by for e in (turns, budget, long_turn, capped, ended)] == [
        "max_turns", "max_episode_tokens", "max_tokens", "turn_cap", None]

    records = [e.record(0.0) for e in (turns, turns, turns, budget, long_turn, ended)]
    stats = episode_stats(records)
    assert stats["rollout/episodes"] == 6.0 and stats["rollout/cut_by_max_turns"] == 3.0
    assert stats["rollout/cut_by_max_episode_tokens"] == stats["rollout/cut_by_max_tokens"] == 1.0
    assert stats["rollout/cut_by_turn_cap"] == 0.0 and stats["rollout/truncated_episodes"] == 5.0
    cfg = PosttrainConfig()
    cfg.rollout.max_turns = 2
    limit, message = truncation_warning(stats, cfg.rollout)
    assert limit == "max_turns"
    assert message.startswith("5 of 6 episodes of this step were cut short by a limit, 3 by rollout.max_turns=2: ")
    # half or fewer cut: no warning; a turn's own cap is named as such
    assert truncation_warning(episode_stats([turns.record(0.0), ended.record(0.0)]), cfg.rollout) is None
    capped_stats = episode_stats([capped.record(0.0)] * 2 + [ended.record(0.0)])
    assert truncation_warning(capped_stats, cfg.rollout)[1].startswith(
        "2 of 3 episodes of this step were cut short by a limit, 2 by a turn's own cap: ")
