"""Async tools (`async def`, in a native environment or a TRL-style class): their calls run on one event loop per
process, so many episodes' calls wait together, and what a tool keeps between calls stays bound to that loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from rl_core.agents import Environment, Reply, ToolCall, Turn, run_tool_call
from rl_core.agents.host import LocalEnvironments
from rl_core.agents.tools import tool_table
from rl_core.agents.trl_style import trl_environment
from rl_core.tasks import Example

EPISODES = 6


class Rendezvous:
    """Calls that each wait until all `n` have started: they all return only if they ran at the same time."""

    def __init__(self, n: int):
        self.n, self.arrived, self.lock, self.all_in = n, 0, None, None

    async def meet(self) -> int:
        if self.lock is None:  # made on the first call's loop, used by every later call: one loop for all
            self.lock, self.all_in = asyncio.Lock(), asyncio.Event()
        async with self.lock:
            self.arrived += 1
            if self.arrived == self.n:
                self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), timeout=30)
        return self.arrived


MEETING = Rendezvous(EPISODES)


async def meet(tag: str) -> str:
    """Wait for every episode's call.

    Args:
        tag: the caller
    """
    return f"{tag}:{await MEETING.meet()}"


async def fail(reason: str) -> str:
    """Always fails.

    Args:
        reason: why
    """
    await asyncio.sleep(0)
    raise ValueError(reason)


class Meeting(Environment):
    tools = (meet, fail)

    def respond(self, turn: Turn) -> Reply:
        return Reply([r.message() for r in self.call_tools(turn.calls)], done=True)

    def reward(self) -> float:
        return 1.0


def test_async_tools_of_many_episodes_run_concurrently_on_one_loop_and_their_errors_are_answers():
    host = LocalEnvironments()
    keys = [f"e{i}" for i in range(EPISODES)]
    openings = host.open(Meeting, [(k, Example("meet", "")) for k in keys])
    assert all(o.error is None for o in openings)
    assert [t["function"]["name"] for t in openings[0].tools] == ["meet", "fail"]
    turn = Turn("", "", (ToolCall("meet", {"tag": "x"}),))
    # one thread per episode, as the scheduler answers episodes: every call waits for all the others (a call run
    # alone, or on a loop of its own, would wait 30 s and answer with its timeout)
    with ThreadPoolExecutor(EPISODES) as threads:
        answers = list(threads.map(lambda k: host.respond([(k, turn)])[0], keys))
    contents = [a.reply.messages[0]["content"] for a in answers]
    assert contents == [f"x:{EPISODES}"] * EPISODES, contents
    assert all(a.tool_calls == 1 and a.tool_errors == 0 for a in answers)

    (env,) = [host.live["e0"]]
    (result,) = env.call_tools([ToolCall("fail", {"reason": "no stock"})])
    assert result.error and result.content == "error: fail raised ValueError: no stock"
    assert [t.name for t in threading.enumerate()].count("async-tools") == 1


class Counter:
    """TRL's convention with an async method: a tool like any other."""

    def reset(self, **kwargs) -> None:
        self.count = 0

    async def bump(self, by: int) -> str:
        """Add to the count.

        Args:
            by: how much
        """
        await asyncio.sleep(0)
        self.count += by
        return str(self.count)


def test_an_async_method_of_a_trl_style_class_is_a_tool_bound_to_its_episode():
    host = LocalEnvironments()
    (opening,) = host.open(trl_environment(Counter), [("k", Example("count", ""))])
    assert opening.error is None and [t["function"]["name"] for t in opening.tools] == ["bump"]
    table = tool_table(host.live["k"].tools)
    assert run_tool_call(table, ToolCall("bump", {"by": 2})).content == "2"
    assert run_tool_call(table, ToolCall("bump", {"by": 3})).content == "5"
    assert run_tool_call(table, ToolCall("bump", {"by": "x", "extra": 1})).error  # arguments checked before the call
