"""OpenEnv environments (rl_core/agents/openenv.py, docs/agents.md): an environment written in OpenEnv's own API,
served by uvicorn on 127.0.0.1 as OpenEnv serves it, plays posttrain episodes through one WebSocket session each."""

from __future__ import annotations

import json
import random

import pytest
from openenv.core.env_server import Action
from pydantic import Field

from rl_core.agents.environment import Turn
from rl_core.agents.host import LocalEnvironments
from rl_core.agents.openenv import _SERVERS, action_tool, openenv_environment, stop_servers
from rl_core.tasks import Example

pytestmark = pytest.mark.e2e  # the environment's server is a process


def call(number) -> Turn:
    return Turn.parse("<tool_call>" + json.dumps({"name": "guess", "arguments": {"number": number}}) + "</tool_call>")


def test_an_openenv_environment_plays_posttrain_episodes_one_session_each():
    from examples.openenv_guess import HIGH, TRIES, GuessTask

    host = LocalEnvironments()
    rows = {key: Example("Find my number.", columns={"seed": seed}) for key, seed in (("a", 3), ("b", 4), ("c", 5))}
    openings = host.open(GuessTask, list(rows.items()))
    assert [o.error for o in openings] == [None] * 3
    assert openings[0].messages == [{"role": "user", "content": f"Find my number.\nI picked a number from 1 to {HIGH}; "
                                                                f"you have {TRIES} guesses."}]
    [schema] = openings[0].tools
    assert schema["function"]["name"] == "guess"
    assert schema["function"]["parameters"] == {
        "type": "object", "required": ["number"],
        "properties": {"number": {"type": "integer", "description": f"a whole number from 1 to {HIGH}"}}}
    secret = {key: random.Random(row.columns["seed"]).randint(1, HIGH) for key, row in rows.items()}  # as reset does

    # a: a wrong guess, a malformed one, then the secret
    wrong = 1 if secret["a"] != 1 else 2
    [answer] = host.respond([("a", call(wrong))])
    assert answer.reply.messages == [{"role": "tool", "name": "guess",
                                      "content": "higher" if wrong < secret["a"] else "lower"}]
    assert not answer.reply.done
    [answer] = host.respond([("a", call("seven"))])  # the server refuses the action: an error the model reads
    assert answer.reply.messages[0]["content"].startswith("error: guess raised") and not answer.reply.done
    [answer] = host.respond([("a", call(secret["a"]))])
    assert answer.reply.messages[0]["content"] == "correct" and answer.reply.done
    # b: a turn without a call ends the episode; c: out of guesses
    [answer] = host.respond([("b", Turn.parse("no idea"))])
    assert answer.reply.done
    wrong = [n for n in range(1, HIGH + 1) if n != secret["c"]][:TRIES]
    for i, number in enumerate(wrong):
        [answer] = host.respond([("c", call(number))])
        assert answer.reply.done == (i == TRIES - 1)
    rewards = {key: end.reward for key, end in zip("abc", host.finish(list("abc")), strict=True)}
    assert rewards == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert len(_SERVERS) == 1  # one server for the process, a session per episode
    [(proc, _)] = _SERVERS.values()
    stop_servers()
    assert proc.poll() is not None and not _SERVERS


def test_an_action_whose_fields_say_nothing_is_refused_when_the_task_is_built():
    class Silent(Action):
        number: int

    with pytest.raises(ValueError, match="number has none"):
        openenv_environment("examples.openenv_guess:app", Silent)
    tool = action_tool(_Described, "pick", "Pick.", lambda f: str(f))  # a tool calls back with the fields
    assert tool(number=3) == "{'number': 3}"


class _Described(Action):
    number: int = Field(description="a number")
