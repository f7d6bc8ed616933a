"""The OpenAI Chat Completions side of the gateway: a request read and checked, the policy's turn written back as a
completion (whole or as server-sent chunks), errors in OpenAI's form, and the conversation compared as the gateway
recorded it.

A request is refused (an `ApiError`, answered with OpenAI's error body and counted) when it names another model than
`MODEL`, asks for more than one choice, sets `temperature` or `top_p` to another value than the recipe samples with,
sets `max_tokens` (or `max_completion_tokens`) below 1, or holds messages or tools that are not in the API's shape.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rl_core.agents.environment import Turn

MODEL = "policy"  # the model name the gateway serves: the policy being trained
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the gateway refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """A checked chat-completions request: its messages and tools as sent, the turn's token cap, streamed or not."""

    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    stream: bool
    include_usage: bool


def read_request(body: Any, *, temperature: float | None = None, top_p: float | None = None) -> Request:
    """`body` (the parsed JSON) as a `Request`, or ApiError naming the field. `temperature` / `top_p`: what the
    recipe samples with (None: not checked)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != MODEL:
        raise ApiError(404, f"the model {model!r} does not exist; this endpoint serves {MODEL!r} (the policy "
                            "being trained)", param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: each request is one turn of the episode", param="n")
    for name, want in (("temperature", temperature), ("top_p", top_p)):
        got = body.get(name)
        if got is not None and want is not None and not _same(got, want):
            raise ApiError(400, f"{name}={got!r}: the recipe samples with {name}={want:g} (the trainer's log-probs "
                                "assume it); leave it out or set that value", param=name)
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise ApiError(400, f"max_tokens={cap!r} must be a positive integer", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                           param=f"messages[{i}]")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise ApiError(400, 'tools must be a list of {"type": "function", "function": {"name": ..., '
                            '"parameters": {...}}}', param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none") and tools:
        raise ApiError(400, f"tool_choice={choice!r}: the policy decides whether to call a tool; only 'auto' and "
                            "'none' are served", param="tool_choice")
    options = body.get("stream_options") or {}
    return Request([dict(m) for m in messages], list(tools) if tools and choice != "none" else None, cap,
                   bool(body.get("stream")), bool(isinstance(options, dict) and options.get("include_usage")))


def _same(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(float(a) - b) <= 1e-6


# ------------------------------------------------------------------ the conversation as the gateway recorded it

def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normal(message: dict) -> tuple:
    """What must match for a message to be the one the gateway recorded: its role, its text, and for an assistant
    turn the calls' names and arguments (ids, names of tool results and other fields are the client's own)."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")),
                                                                 sort_keys=True))
                  for c in message.get("tool_calls") or () if isinstance(c, dict))
    return message.get("role"), _text(message.get("content")).strip(), calls


def template_message(message: dict) -> dict:
    """A message of the client's as the chat template takes it: text content, and calls' arguments as objects."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_call_id")}
    out["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                "arguments": _arguments(c["function"].get("arguments"))}}
                             for c in message["tool_calls"]]
    return out


# ----------------------------------------------------------------------------------- the policy's turn, answered

def assistant_message(turn: Turn) -> dict:
    """The turn as the API's assistant message: its text outside the calls, and the calls that parsed."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    calls = [c for c in turn.calls if c.error is None]
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                                 for c in calls]
    elif turn.calls:  # only malformed calls: the agent reads what the policy wrote
        message["content"] = turn.text
    return message


def finish_reason(message: dict) -> str:
    """A turn the agent is answered with stopped on its own (one cut by its budget ends the episode unanswered)."""
    return "tool_calls" if message.get("tool_calls") else "stop"


def completion(message: dict, finish: str, usage: dict) -> dict:
    """The non-streamed response."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage}


def chunks(message: dict, finish: str, usage: dict, include_usage: bool) -> list[dict]:
    """The streamed response's chunks: the role and the text, each call, the finish reason, and the usage when
    `stream_options.include_usage` asked for it."""
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(delta: dict | None, reason: str | None = None, **extra: Any) -> dict:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                "choices": choices, **extra}

    out = [chunk({"role": "assistant", "content": message.get("content") or ""})]
    for i, call in enumerate(message.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, finish))
    if include_usage:
        out.append(chunk(None, usage=usage))
    return out
