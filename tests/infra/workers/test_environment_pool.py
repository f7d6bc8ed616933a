"""The environment pool: an agent task's environments in Ray actors, one share of the episodes each; the answers
equal the driver's (`LocalEnvironments`), a tool that hangs or crashes loses only its actor's episodes (ended as
environment errors, reward 0), the others go on, and fresh actors serve the next rollout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rl_core.agents import Turn
from rl_core.agents.host import LocalEnvironments
from rl_core.config import load_config
from rl_core.tasks import Example
from tests import user_code

ENV = "data.task=tests.user_code:WaitingRoom"


def _call(seconds: float) -> Turn:
    call = json.dumps({"name": "wait", "arguments": {"seconds": seconds}})
    return Turn.parse(f"<tool_call>{call}</tool_call>")


@pytest.mark.e2e  # the environment workers are Ray actors
def test_the_pool_answers_as_the_driver_and_a_hanging_or_crashing_tool_loses_only_its_actors_episodes():
    from infra.workers.environments import EnvironmentPool
    from tests.user_code import WaitingRoom

    timeout = 5  # s; above what a loaded 2-core machine takes to answer a call that does not hang
    cfg = load_config("recipes/arithmetic.py", [ENV, "data.prompt_template=chat", "data.env_workers=2",
                                                f"data.env_timeout_s={timeout}"])
    rows = [(f"e{i}", Example(f"row {i}", "0", None, {}, f"f.jsonl:{i + 1}")) for i in range(4)]  # e0, e2: actor 0
    local = LocalEnvironments()
    with EnvironmentPool(cfg) as pool:
        assert len(pool.actors) == 2
        openings = pool.open(WaitingRoom, rows)
        want = local.open(WaitingRoom, rows)
        assert [(o.messages, o.tools, o.error) for o in openings] == [(o.messages, o.tools, o.error) for o in want]
        assert openings[0].tools[0]["function"]["name"] == "wait"

        turns = [(key, _call(0)) for key, _ in rows]
        got, expected = pool.respond(turns), local.respond(turns)
        assert [(a.reply, a.tool_calls, a.tool_errors, a.error) for a in got] == \
            [(a.reply, a.tool_calls, a.tool_errors, a.error) for a in expected]
        assert got[0].reply.messages == [{"role": "tool", "name": "wait", "content": "waited 0 s"}]

        # e0's tool hangs: actor 0 is killed after the timeout with e0 and e2; e1 and e3 go on
        began = time.monotonic()
        got = pool.respond([("e0", _call(60)), ("e1", _call(0)), ("e3", _call(0))])
        assert time.monotonic() - began < timeout + 5
        assert got[0].lost and f"data.env_timeout_s={timeout} s" in got[0].error and "2 episode(s)" in got[0].error
        assert not got[1].lost and got[1].tool_calls == 2 and not got[2].lost
        (e2,) = pool.respond([("e2", _call(0))])  # lost with its actor, answered at once
        assert e2.lost and "data.env_timeout_s" in e2.error
        finished = pool.finish([key for key, _ in rows])
        assert [a.lost for a in finished] == [True, False, True, False]
        assert [a.reward for a in finished[1::2]] == [2.0, 2.0]

        # no rollout in flight: fresh actors; a crash (the tool ends its process) loses that actor's episodes only
        assert [o.error for o in pool.open(WaitingRoom, rows)] == [None] * 4
        assert len(pool.actors) == 2 and not pool.dead
        got = pool.respond([("e1", _call(-1)), ("e0", _call(0))])
        assert got[0].lost and "died during respond" in got[0].error
        assert got[1].reply is not None and not got[1].lost
        pool.discard([key for key, _ in rows])

        # what the environment's own code raises is its error, not a loss: the rollout names the row
        rows = [("r0", Example("bad reward", "0", None, {}, "f.jsonl:9"))]
        pool.open(WaitingRoom, rows)
        (answer,) = pool.finish(["r0"])
        assert not answer.lost and answer.retryable  # a ValueError: not a programming error, so the step retries
        raised = 'raise ValueError("no score for this row")'
        line = next(i for i, text in enumerate(Path(user_code.__file__).read_text().splitlines(), 1) if raised in text)
        assert answer.error == f"WaitingRoom.reward() raised ValueError: no score for this row at {user_code.__file__}:{line}"
        assert pool.where == {} and pool.lost == {}
