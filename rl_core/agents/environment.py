"""The environment interface: one episode of an agent's conversation, created from a dataset row.

    class Guess(Environment):
        def reset(self):
            self.secret, self.tries = int(self.example.answer), 0
            return [{"role": "user", "content": "Guess my number (1-100)."}]

        def respond(self, turn):
            self.tries += 1
            guess = turn.content.strip()
            if guess == str(self.secret):
                self.solved = True
                return Reply(done=True)
            hint = "higher" if guess.isdigit() and int(guess) < self.secret else "lower"
            return Reply([{"role": "user", "content": hint}])

        def reward(self):
            return float(getattr(self, "solved", False))

An environment gives the opening messages (`reset`), answers each assistant turn with the next messages or
ends the episode (`respond`), and scores the episode (`reward`). Its `tools` are plain functions (see
`rl_core.agents.tools`): their schemas go to the chat template's `tools=`, and the default `respond` runs the
calls of a turn and answers with their results, ending the episode at the first turn without a call.

`respond` receives a `Turn`: the assistant's text as sampled, the text outside its tool calls (`content`) and the
parsed calls (a malformed one carries its error); `turn.message` is the turn in TRL's conversational form,
`{"role": "assistant", "content": ..., "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}`.
The episode's token ids are the sampler's, never the text re-rendered (`rl_core.agents.episode`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.agents.tools import (
    ToolCall,
    ToolResult,
    parse_tool_calls,
    run_tool_call,
    tool_schema,
    tool_table,
)


@dataclass(frozen=True)
class Turn:
    """One assistant turn: `text` as sampled (special tokens dropped), `content` without the tool calls, `calls`."""

    text: str
    content: str
    calls: tuple[ToolCall, ...] = ()
    sampled_tokens: int = 0  # the ids the policy sampled for it
    context_tokens: int = 0  # the episode's ids before it

    @classmethod
    def parse(cls, text: str, style: str = "hermes") -> Turn:
        """The turn `text`, its calls read in the chat template's tool-call format (`tool_call_format`)."""
        content, calls = parse_tool_calls(text, style)
        return cls(text, content, tuple(calls))

    @property
    def message(self) -> dict:
        """The turn in TRL's conversational form (`tool_calls` only for calls that parsed)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        good = [c for c in self.calls if c.error is None]
        if good:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                     for c in good]
        return message


@dataclass
class Reply:
    """The environment's answer to a turn: the next messages (tool results, a user turn) and whether the episode
    ends (then `messages` is usually empty); `max_tokens` caps the next turn below `rollout.max_tokens` (None: no
    cap of its own).

    `new_sample`: `messages` is not an addition but the whole conversation from now on (a compacted or edited
    history): the episode's ids so far end as one training sample, and its next sample opens with these messages
    rendered as a prompt, with `tools` (None: the episode's tools; [] none). Each sample trains with its own mask
    and the episode's advantage (`rl_core.agents.episode`).

    `reward`: a reward for the turn this reply answers, on that turn's last token, beside the episode's reward at its
    end. PPO's GAE reads it (`rl.objective.type=ppo`: a return counts every reward after a token); the group-relative
    objectives read the episode's reward only."""

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    max_tokens: int | None = None
    new_sample: bool = False
    tools: list[dict] | None = None
    reward: float | None = None


class Environment:
    """One episode (subclass it). `example` is the dataset row's `rl_core.tasks.Example`; `tools` the functions
    the model may call."""

    tools: Sequence[Callable] = ()
    first_turn_max_tokens: int | None = None  # caps the first turn below rollout.max_tokens (None: no cap of its own)

    def __init__(self, example: Any):
        self.example = example
        self.tool_results: list[ToolResult] = []  # every call's result, in order (errors included)
        self._table: dict[str, Callable] | None = None

    def reset(self) -> list[dict]:
        """The opening messages; by default the row's chat messages, else its prompt as one user message."""
        if getattr(self.example, "messages", None):
            return [dict(m) for m in self.example.messages]
        return [{"role": "user", "content": self.example.prompt}]

    def respond(self, turn: Turn) -> Reply:
        """The reply to an assistant turn: the results of its tool calls, or the end of the episode without any."""
        if not turn.calls:
            return Reply(done=True)
        return Reply([result.message() for result in self.call_tools(turn.calls)])

    def reward(self) -> float:
        """The episode's reward, read once it has ended."""
        raise NotImplementedError(f"{type(self).__name__} must define reward()")

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a client), once its reward is read or it is discarded; called
        once, also when the episode failed."""

    # -- tools
    def tool_schemas(self) -> list[dict] | None:
        """The JSON schemas the chat template renders (None: no tools), read once `reset` has run."""
        return [tool_schema(fn) for fn in self.tools] or None

    def call_tools(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run `calls` against `tools` (errors become error results, `rl_core.agents.tools.run_tool_call`), keeping
        each result in `tool_results`."""
        if self._table is None:
            self._table = tool_table(self.tools)
        results = [run_tool_call(self._table, call) for call in calls]
        self.tool_results.extend(results)
        return results

