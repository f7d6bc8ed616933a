"""A reply longer than the episode's token budget can hold is measured on a prefix, never rendered or tokenized whole
(rl_core.agents.episode): the episode ends truncated by its budget, as any reply that does not fit, and
`rollout/oversized_replies` counts it; a long reply that the template renders short still fits, whole."""

from __future__ import annotations

import pytest

from rl_core.agents import Environment, Episode
from rl_core.tasks import Example
from tests.rl_core.test_agents import HERMES, sample, tokenizer
from tests.rl_core.test_tool_call_limits import Scripted

BIG = 5_000_000  # characters of the tool's answer
CALL = '<tool_call>{"name": "dump", "arguments": {"size": %d}}</tool_call>'
# shows the model the first 10 characters of a tool's answer only: a long answer then fits in a few tokens
SHOWS_10 = HERMES.replace("<tool_response>{{ m.content }}", "<tool_response>{{ m.content[:10] }}")


def dump(size: int) -> str:
    """Return `size` characters of output.

    Args:
        size: how many characters
    """
    return "x" * size


class Flood(Environment):
    tools = (dump,)

    def reset(self):
        size = int(self.example.columns.get("opening", 0))
        return [{"role": "user", "content": self.example.prompt + "y" * size}]

    def reward(self):
        return 0.0


def spied(template: str = HERMES) -> tuple[object, list[int]]:
    """The test tokenizer, and the list that gets the characters of every text its chat template renders."""
    tok = tokenizer(template)
    rendered: list[int] = []
    render = tok.apply_chat_template

    def apply_chat_template(messages, **kwargs):
        out = render(messages, **kwargs)
        rendered.append(len(out) if isinstance(out, str) else len(out["input_ids"]))
        return out

    tok.apply_chat_template = apply_chat_template
    return tok, rendered


def test_a_reply_far_over_the_budget_is_never_rendered_whole_and_ends_the_episode_counted():
    from rl_core.agents.rollout import episode_stats

    tok, rendered = spied()
    episode = Episode(Flood(Example("go", "")), tok, max_turns=4, max_tokens=2000)
    sample(episode, CALL % BIG)
    assert episode.done and episode.truncated
    assert max(rendered) < 100_000  # what the template rendered and the tokenizer read: a prefix of the reply
    assert episode.messages[-1]["role"] == "assistant"  # the reply that did not fit is not in the conversation
    stats = episode.stats()
    assert (stats["tool_calls"], stats["tool_errors"], stats["oversized_replies"]) == (1, 0, 1)
    assert episode_stats([episode.record(0.0)])["rollout/oversized_replies"] == 1.0


def test_only_replies_that_do_not_fit_are_counted_and_what_fits_is_never_cut():
    tok, _ = spied()
    fits = Episode(Flood(Example("go", "")), tok, max_turns=4, max_tokens=2000)
    sample(fits, CALL % 1000)
    assert not fits.done and fits.messages[-1]["content"] == "x" * 1000 and fits.stats()["oversized_replies"] == 0
    room = fits.max_tokens - len(fits.ids)
    sample(fits, CALL % room)  # the answer alone fills what is left: it does not fit, as before the cut existed
    assert fits.done and fits.truncated and fits.stats()["oversized_replies"] == 1

    tok, rendered = spied(SHOWS_10)  # 5 MB that the template shows as 10 characters fit the budget: kept whole
    short = Episode(Flood(Example("go", "")), tok, max_turns=4, max_tokens=2000)
    sample(short, CALL % BIG)
    assert not short.done and short.messages[-1]["content"] == "x" * BIG
    assert short.stats()["oversized_replies"] == 0 and max(rendered) < 2000


def test_the_cut_counts_string_content_and_text_parts_and_leaves_the_rest_out():
    from rl_core.agents.episode import cut_messages

    image = {"type": "image", "url": "x.png"}
    messages = [{"role": "user", "content": "abcd"},
                {"role": "user", "content": [{"type": "text", "text": "efgh"}, image, {"type": "text", "text": "ij"}]},
                {"role": "tool", "name": "t", "content": "klm"}]
    assert cut_messages(messages, 13) == (messages, False)
    assert cut_messages(messages, 9) == ([messages[0], {"role": "user", "content": [
        {"type": "text", "text": "efgh"}, image, {"type": "text", "text": "i"}]}], True)
    assert cut_messages(messages, 2) == ([{"role": "user", "content": "ab"}], True)
    assert cut_messages(["not a message"], 0) == (["not a message"], False)


def test_an_opening_far_over_the_budget_is_never_rendered_whole():
    tok, rendered = spied()
    with pytest.raises(ValueError, match=r"the opening prompt has more than 2000 tokens \(5000002 characters"):
        Episode(Flood(Example("go", "", columns={"opening": BIG})), tok, max_turns=4, max_tokens=2000)
    assert max(rendered) < 100_000


def test_a_rollout_counts_the_oversized_reply_and_its_episode_ends_by_the_budget():
    from rl_core.agents.rollout import episode_stats, rollout_episodes
    from rl_core.rollout import SamplingParams
    from rl_core.tasks import get_task

    tok, rendered = spied()
    out, _ = rollout_episodes(Scripted(tok, [CALL % BIG]), get_task("tests.rl_core.test_oversized_replies:Flood"),
                              [Example("go", "")], tok, 1, SamplingParams(temperature=1.0, max_tokens=100, seed=1),
                              max_turns=4, max_episode_tokens=2000)
    (record,) = out.episodes
    assert out.finish_reason == ["length"] and record["error"] is None and record["stats"]["truncated"]
    assert episode_stats(out.episodes)["rollout/oversized_replies"] == 1.0
    assert max(rendered) < 100_000
