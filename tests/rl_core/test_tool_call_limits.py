"""A sampled tool call never stops a rollout: calls nested too deep for the JSON parser, numbers past Python's digit
limit, over-long bodies and nesting that the parser takes but pickle or json.dumps would not are all error answers
(rl_core.agents.tools), and an episode holding one plays on, is recorded and round-trips the rollout cache."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import torch

from rl_core.agents import Episode, Turn, parse_tool_calls
from rl_core.agents.tools import MAX_CALL_CHARS, MAX_CALL_DEPTH
from rl_core.tasks import Example
from tests.rl_core.test_agents import Sums, ids_of, sample, tokenizer


def call(arguments: str) -> str:
    """A calculator call as the model writes it, `arguments` the JSON text of its arguments."""
    return f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'


def expression(value: str) -> str:
    """Calculator arguments whose `expression` is the JSON text `value`."""
    return f'{{"expression": {value}}}'


GOOD = call(expression('"1+1"'))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def bad_calls() -> dict[str, str]:
    """One tool call of each kind the parser must answer with an error, as the model would write it."""
    return {
        "deep": call(expression(nested(5000))),  # RecursionError in json.loads
        "deep as a string": call(json.dumps(expression(nested(900)))),
        "deep enough to break pickle": call(expression(nested(900))),  # json.loads takes it
        "huge number": call(expression("9" * 5000)),  # ValueError: int max str digits
        "huge number as a string": call(json.dumps(expression("9" * 5000))),
        "long": call(expression(json.dumps("1+" * MAX_CALL_CHARS + "1"))),
    }


def test_calls_the_parser_cannot_take_are_error_answers_naming_why():
    for kind, text in bad_calls().items():
        content, (parsed,) = parse_tool_calls("ok " + text)
        assert content == "ok", kind
        assert parsed.error is not None and not parsed.arguments, kind
    errors = {kind: parse_tool_calls(text)[1][0].error for kind, text in bad_calls().items()}
    assert errors["deep"] == f"the tool call nests deeper than {MAX_CALL_DEPTH} levels"
    assert errors["deep enough to break pickle"] == errors["deep"]
    assert errors["deep as a string"] == "the arguments of calculator are not a JSON object"
    assert errors["huge number"].startswith("the tool call cannot be read (Exceeds the limit (4300 digits)")
    assert errors["huge number as a string"] == "the arguments of calculator are not a JSON object"
    body = bad_calls()["long"].removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert errors["long"] == f"the tool call has {len(body)} characters; a call holds at most {MAX_CALL_CHARS}"
    # within the limits a call parses as before, nesting and long numbers included
    inside = call(json.dumps({"expression": json.loads(nested(MAX_CALL_DEPTH - 2)), "n": int("9" * 4000)}))
    (parsed,) = parse_tool_calls(inside)[1]
    assert parsed.error is None and parsed.arguments["n"] == int("9" * 4000)


def test_a_turn_with_such_a_call_pickles_and_dumps_as_the_rollout_needs():
    """The Turn goes to the environment actors by pickle and its message into the episode's JSON record."""
    for kind, text in bad_calls().items():
        turn = Turn.parse(text)
        assert pickle.loads(pickle.dumps(turn)) == turn, kind
        json.dumps(turn.message)


def test_an_episode_with_such_calls_is_answered_and_plays_on():
    tok = tokenizer()
    episode = Episode(Sums(Example("1+1?", "2")), tok, max_turns=10, max_tokens=4 * MAX_CALL_CHARS)
    for text in bad_calls().values():
        sample(episode, text)
        assert not episode.done and episode.messages[-1]["content"].startswith("error: ")
    sample(episode, GOOD)
    assert episode.messages[-1] == {"role": "tool", "name": "calculator", "content": "2"}
    sample(episode, "2")
    assert episode.done and not episode.truncated and episode.env.reward() == 1.0
    assert episode.stats()["tool_calls"] == len(bad_calls()) + 1 and episode.stats()["tool_errors"] == len(bad_calls())


class Scripted:
    """A rollout engine that answers every live episode's context with the next of `turns` (one per engine call)."""

    policy_version = 0

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns = tok, list(turns)

    def generate(self, contexts, n, params):
        text, self.turns = self.turns[0], self.turns[1:]
        turn = ids_of(self.tok, text) + [self.tok.eos_token_id]
        rows = [torch.tensor(list(c) + turn) for c in contexts]
        masks = [torch.tensor([0] * len(c) + [1] * len(turn)) for c in contexts]
        return SimpleNamespace(input_ids=rows, response_mask=masks, policy_version=0, token_version=None,
                               finish_reason=["stop"] * len(rows), sampling_logp=[m.float() * -0.5 for m in masks])


def test_a_rollout_whose_episode_makes_such_calls_goes_on_and_its_records_reach_the_cache(tmp_path):
    from rl_core.agents.rollout import episode_stats, rollout_episodes
    from rl_core.rollout import Completions, SamplingParams
    from rl_core.tasks import get_task

    tok = tokenizer()
    turns = [*bad_calls().values(), GOOD, "2"]
    out, _ = rollout_episodes(Scripted(tok, turns), get_task("tests.rl_core.test_agents:Sums"), [Example("1+1?", "2")],
                              tok, 1, SamplingParams(temperature=1.0, max_tokens=4 * MAX_CALL_CHARS, seed=1),
                              max_turns=len(turns), max_episode_tokens=8 * MAX_CALL_CHARS)
    (record,) = out.episodes
    assert record["reward"] == 1.0 and record["error"] is None and out.finish_reason == ["stop"]
    stats = episode_stats(out.episodes)
    assert stats["rollout/tool_errors"] == len(bad_calls()) and stats["rollout/turns_mean"] == len(turns)
    out.save(tmp_path / "c.safetensors")
    assert Completions.load(tmp_path / "c.safetensors").episodes == out.episodes
