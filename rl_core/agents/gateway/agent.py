"""An agent function as an environment: `data.task=package.module:my_agent` names a function

    def my_agent(client: openai.OpenAI, row: dict) -> float | None          (or `async def`, with openai.AsyncOpenAI)

that runs the user's agent against `client` (its `base_url` and `api_key` are the episode's session on the gateway)
for the dataset row (`prompt` or `messages`, `answer`, the other columns) and returns the episode's reward (None: the
reward is left to `data.rewards`, which read the recorded conversation).

The function runs in a thread of its own beside the environment (`AgentEnvironment`), and the environment is the
other side of the gateway: `reset` waits for the agent's first request and opens the episode with its messages and
tools; the policy samples the turn on the engines as for any environment (`rl_core.agents.episode`: token ids kept
as sampled, the environment's tokens masked, the rollout's scheduling and seeds); `respond` answers the waiting
request with the turn and waits for the next one, whose new messages (tool results, a user turn) are the reply. The
agent function returning ends the episode. The agent runs its tools itself: each tool message it sends back counts as
a call (`rollout/tool_calls_mean`), never as a tool error (posttrain reads the answer, not whether the tool failed).

The token-exact rule. A request continues the episode when its messages begin with the conversation as the gateway
recorded it (the first request's messages, each turn as it was answered, each later request's new messages),
compared by role, text and calls (`normal`), and it brings the same tools: then only the new messages are rendered
(the chat template's delta) and appended after the ids the policy sampled, which are never re-tokenized. A request
that does not continue it (a conversation edited, compacted or re-ordered, a template that drops earlier turns'
reasoning, other tools) starts a new sample of the same episode (`Reply(new_sample=True)`): the ids so far are one
training sample, and the next opens with the request's whole conversation rendered as a prompt, so no token the
policy did not sample is ever trained on; the split is counted (`rollout/new_samples`). A request that repeats
the conversation without adding a message is refused (400), as the turn it asks for was answered already.

Time: the environment's calls are bounded as any environment's (`data.env_timeout_s` on the environment actors):
`reset` until the first request, `respond` until the next one. An episode that reaches a limit (`rollout.max_turns`,
`rollout.max_episode_tokens`, a turn cut by its token budget) ends; the agent's request waiting then, and any later
one, is refused (409, `episode_ended`), and `reward` waits at most `END_WAIT_S` for the function to return.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from rl_core.agents.environment import Environment, Reply, Turn
from rl_core.agents.gateway.messages import (
    ApiError,
    assistant_message,
    finish_reason,
    normal,
    template_message,
)
from rl_core.agents.tools import ToolResult
from rl_core.user_code import user_error

log = logging.getLogger("posttrain.gateway")
END_WAIT_S = 30.0  # how long `reward` waits for an agent function whose episode has ended to return


def is_agent_function(obj: Any) -> bool:
    """A plain or async function (not a class): `data.task` names an agent function. ValueError when it cannot be
    called as one, `fn(client, row)`."""
    if not (inspect.isfunction(obj) or inspect.iscoroutinefunction(obj)):
        return False
    try:
        inspect.signature(obj).bind(None, None)
    except TypeError as exc:
        raise ValueError(f"{obj.__qualname__}{inspect.signature(obj)}: an agent function is called as "
                         f"fn(client, row) ({exc})") from None
    return True


@functools.cache
def agent_environment(fn: Callable) -> type[Environment]:
    """The environment that runs `fn` once per episode (module docstring); one class per function."""
    name = getattr(fn, "__name__", "agent")
    return type(name, (AgentEnvironment,), {"agent": staticmethod(fn), "__doc__": f"the agent function {name}"})


def row_of(example: Any) -> dict:
    """What the agent function receives of its dataset row."""
    prompt = [dict(m) for m in example.messages] if example.messages else example.prompt
    return {"prompt": prompt, "answer": example.answer, **dict(example.columns)}


class AgentEnvironment(Environment):
    """One episode of the agent function `agent` behind the gateway (module docstring)."""

    agent: Callable[..., Any]
    sampling: ClassVar[dict[str, float | None]] = {}  # the recipe's temperature and top_p (`configure`)

    @classmethod
    def configure(cls, temperature: float | None, top_p: float | None) -> None:
        """The sampling a request's `temperature` / `top_p` must match (what the recipe samples with)."""
        cls.sampling = {"temperature": temperature, "top_p": top_p}

    def reset(self) -> list[dict]:
        from rl_core.agents.gateway.server import shared_gateway

        self.gateway = shared_gateway()
        self.gateway.sampling.update(self.sampling)
        self.session = self.gateway.sessions.open()
        self.value: Any = None
        self.failure: str | None = None
        self.recorded: list[tuple] = []
        self.request_tools: list[dict] | None = None
        self.first_turn_max_tokens: int | None = None
        self._waiting: Any = None
        self.thread = threading.Thread(target=self._run, name=f"agent {type(self).__name__}", daemon=True)
        self.thread.start()
        request = self._next(first=True)
        if request is None:
            self.gateway.sessions.drop(self.session)
            raise RuntimeError(f"the agent function {type(self).__name__} ended before its first request"
                               + (f": {self.failure}" if self.failure else ""))
        self.recorded = [normal(m) for m in request.messages]
        return [template_message(m) for m in request.messages]

    def tool_schemas(self) -> list[dict] | None:
        return self.request_tools

    def respond(self, turn: Turn) -> Reply:
        message = assistant_message(turn)
        usage = {"prompt_tokens": turn.context_tokens, "completion_tokens": turn.sampled_tokens,
                 "total_tokens": turn.context_tokens + turn.sampled_tokens}
        waiting, self._waiting = self._waiting, None
        if not waiting.done():
            waiting.set_result((message, finish_reason(message), usage))
        self.recorded.append(normal(message))
        before = len(self.recorded)
        request = self._next()
        if request is None:
            if self.failure is not None:
                raise RuntimeError(f"the agent function raised {self.failure}")
            return Reply(done=True)
        names = {c["id"]: c["function"]["name"] for c in message.get("tool_calls") or ()}
        fresh = not self._continues(request)
        # the turn's tool results: the new messages, or in a new sample's conversation those answering its calls
        new = [m for m in request.messages if m.get("tool_call_id") in names] if fresh else request.messages[before:]
        self.tool_results += [ToolResult(names.get(m.get("tool_call_id"), str(m.get("name") or "")),
                                         template_message(m)["content"], False) for m in new if m["role"] == "tool"]
        if fresh:
            self.recorded, self.request_tools = [normal(m) for m in request.messages], request.tools
            return Reply([template_message(m) for m in request.messages], max_tokens=request.max_tokens,
                         new_sample=True, tools=request.tools or [])
        self.recorded += [normal(m) for m in new]
        return Reply([template_message(m) for m in new], max_tokens=request.max_tokens)

    def reward(self) -> float:
        self.gateway.sessions.drop(self.session)  # a request waiting now is refused: the episode has ended
        self.thread.join(timeout=END_WAIT_S)
        if self.thread.is_alive():
            log.warning("the agent function %s did not return within %g s of its episode's end; its reward is 0",
                        type(self).__name__, END_WAIT_S)
            return 0.0
        if self.failure is not None:
            # an agent that stops on the refusal of a request made after its episode's limit is the usual end there
            level = logging.DEBUG if self.session.ended else logging.WARNING
            log.log(level, "the agent function %s raised %s; its reward is 0", type(self).__name__, self.failure)
            return 0.0
        return 0.0 if self.value is None else float(self.value)

    @property
    def refused_requests(self) -> int:
        """The agent's requests refused as bad (not those made after the episode ended): `rollout/refused_requests`."""
        session = getattr(self, "session", None)
        return 0 if session is None else session.refused - session.ended

    def close(self) -> None:
        """The episode has ended, or is dropped without a reward (its rollout failed): the agent's requests are
        refused from now on, so its thread ends."""
        if getattr(self, "session", None) is not None:
            self.gateway.sessions.drop(self.session)

    # -- the agent's side
    def _run(self) -> None:
        from openai import AsyncOpenAI, OpenAI

        options = {"base_url": self.gateway.base_url(self.session.id), "api_key": self.gateway.sessions.secret,
                   "max_retries": 0, "timeout": None}
        row = row_of(self.example)
        try:
            if inspect.iscoroutinefunction(self.agent):
                async def run() -> Any:
                    async with AsyncOpenAI(**options) as client:
                        return await self.agent(client, row)
                self.value = asyncio.run(run())
            else:
                with OpenAI(**options) as client:
                    self.value = self.agent(client, row)
        except BaseException as exc:  # noqa: BLE001 - the agent's failure ends its episode, named
            self.failure = user_error(exc)
        finally:
            self.session.end()

    def _next(self, first: bool = False) -> Any:
        """The agent's next request that asks for a turn (refusing those that do not), or None once the function
        has ended."""
        while (item := self.session.next()) is not None:
            request, future = item
            problem = self._breaks(request, first)
            if problem is None:
                self._waiting = future
                if first:
                    self.request_tools, self.first_turn_max_tokens = request.tools, request.max_tokens
                return request
            self.session.refuse(future, ApiError(400, problem, code="no_new_message"))
        return None

    def _continues(self, request: Any) -> bool:
        """Whether `request` brings the episode's tools and begins with its conversation as recorded (module
        docstring): its new messages are then a delta after the sampled ids; else it starts a new sample."""
        sent = [normal(m) for m in request.messages]
        return request.tools == self.request_tools and sent[:len(self.recorded)] == self.recorded

    def _breaks(self, request: Any, first: bool) -> str | None:
        """Why `request` asks for no turn (it repeats the conversation so far), or None."""
        if not first and self._continues(request) and len(request.messages) == len(self.recorded):
            return ("the request adds no message to the conversation; send the turn's tool results or a user message "
                    "(the turn it asks for was answered already)")
        return None
