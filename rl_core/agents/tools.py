"""Tools an agent calls: their JSON schemas, the calls parsed from the model's text, and the calls run.

A tool is a plain Python function with type hints and a Google-style docstring (`Args:` naming each
parameter). Its schema is transformers' `get_json_schema(fn)`, the form a chat template's `tools=`
takes, so the model sees the tools the way its template presents them.

Calls are read in the format the chat template teaches (`tool_call_format`): by default the Hermes / Qwen format
the Qwen2.5 and Qwen3 templates teach, each call a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`; Llama 3.1-3.3's bare JSON calls and Mistral's `[TOOL_CALLS]` lists too. Whatever goes wrong
with a call (text that is not JSON, no name, arguments that are not an object, a tool that does not
exist, arguments it does not take, a tool that raises or returns something that is not text or JSON)
becomes an error message the model reads as the tool's answer, and is counted: never an exception that
stops the episode. That holds for calls the JSON parser cannot take too: a body over `MAX_CALL_CHARS`
characters is not parsed at all (it is answered naming the cap), and nesting past Python's recursion limit
or a number past its integer digit limit (4300) is answered as unreadable. A call nested deeper than
`MAX_CALL_DEPTH` levels is answered too, though the parser takes up to about a thousand: the turn holding it
is pickled to the environment actors and written into the episode's JSON record, and both recurse once per
level from a deeper stack than the parser's.

A tool may be an `async def` (or return an awaitable): its calls run on one event loop per process, in a thread of
its own, so many episodes' calls wait on I/O together, and what a tool keeps between calls (a client session, a
lock) stays bound to the loop it was made on. The episode's thread waits for its call's result. An async tool
must not block its loop (a blocking tool is a plain `def`, which runs in the episode's thread).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.user_code import user_error

TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
ERROR_PREFIX = "error: "
MAX_CALL_CHARS = 64 * 1024  # characters of one call's body (between the tags): ample for any tool's arguments
MAX_CALL_DEPTH = 64  # levels of objects and arrays in one call, the arguments' own included
FORMATS = ("hermes", "llama3_json", "mistral")
MISTRAL_LIST = re.compile(r'\[\s*\{\s*"name"')  # [TOOL_CALLS][{"name": ...}] without its token
# `name{...}`: Mistral's [TOOL_CALLS]name[ARGS]{...} without its tokens
MISTRAL_CALL = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*(?=\{)")


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: `name` and `arguments` when it parsed, else `error` says why not."""

    name: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of tool `fn` (transformers' `get_json_schema`); ValueError naming the function and what its
    docstring or type hints lack."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"tool {name}{_defined_at(fn)}: no JSON schema ({exc}); a tool is a function with type "
                         "hints on every parameter and a docstring whose `Args:` section describes each one") from exc


def _defined_at(fn: Callable) -> str:
    """` (file:line)` where `fn` is defined, when Python knows it, else nothing."""
    fn = inspect.unwrap(fn)
    try:
        return f" ({inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno})"
    except (TypeError, AttributeError):
        return ""


def tool_table(tools: Sequence[Callable]) -> dict[str, Callable]:
    """`{name: fn}` of `tools`, each checked for a schema; ValueError on two tools of one name."""
    table: dict[str, Callable] = {}
    for fn in tools:
        name = tool_schema(fn)["function"]["name"]
        if name in table:
            raise ValueError(f"two tools are named {name!r}; tool names must be unique")
        table[name] = fn
    return table


def tool_call_format(chat_template: str | Mapping[str, str] | None) -> str:
    """The tool-call format a chat template teaches (one of FORMATS): `hermes` for `<tool_call>` blocks (Qwen2.5,
    Qwen3, Hermes and most templates), `mistral` for one that writes `[TOOL_CALLS]`, `llama3_json` for Llama
    3.1-3.3's bare JSON calls (`<|python_tag|>`, `"parameters"`); `hermes` when it shows none of them."""
    template = "\n".join(chat_template.values()) if isinstance(chat_template, Mapping) else chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def parse_tool_calls(text: str, style: str = "hermes") -> tuple[str, list[ToolCall]]:
    """The text outside the calls (stripped) and the calls, in order, read in format `style` (`tool_call_format`;
    the text is decoded without special tokens, so Mistral's `[TOOL_CALLS]` and Llama's `<|python_tag|>` are gone):

    - `hermes`: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block; a block the model did not
      close (it stopped or ran out of tokens inside it) is a call with an error;
    - `llama3_json`: a turn that is a JSON object (`{"name": ..., "parameters": {...}}`), or several joined by `;`;
    - `mistral`: a JSON list of calls at the turn's end (`[{"name": ..., "arguments": {...}}]`), the text before
      it the content; or calls written `name{...}` (the `[TOOL_CALLS]name[ARGS]{...}` form) making up the turn.
    """
    if style == "llama3_json":
        stripped = text.strip()
        if not stripped.startswith("{"):
            return stripped, []
        return "", _parse_llama(stripped)
    if style == "mistral":
        return _parse_mistral(text.strip())
    if style != "hermes":
        raise ValueError(f"unknown tool-call format {style!r}; one of {', '.join(FORMATS)}")
    calls = []
    for match in TOOL_CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_parse_call(body) if closed else ToolCall(error="the <tool_call> block is not closed"))
    return TOOL_CALL.sub("", text).strip(), calls


def _parse_llama(text: str) -> list[ToolCall]:
    """Llama's calls: JSON objects joined by `;`; where the rest does not read as one, it is a call with an error."""
    calls, rest = [], text
    while rest:
        try:
            _, end = json.JSONDecoder().raw_decode(rest)
        except (ValueError, RecursionError):
            return [*calls, _parse_call(rest)]  # the error, said as for any call
        calls.append(_parse_call(rest[:end]))
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return calls


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    found = MISTRAL_LIST.search(text)
    if found is not None:
        start = found.start()
        body = text[start:]
        if len(body) > MAX_CALL_CHARS:
            return text[:start].strip(), [ToolCall(error=f"the tool calls have {len(body)} characters; at most "
                                                         f"{MAX_CALL_CHARS}")]
        try:
            items = _read_json(body, depth=-1)
        except json.JSONDecodeError as exc:
            return text[:start].strip(), [ToolCall(error=f"the tool calls are not JSON ({exc.msg} at character "
                                                         f"{exc.pos})")]
        except (RecursionError, _TooDeep):
            return text[:start].strip(), [ToolCall(error=f"the tool calls nest deeper than {MAX_CALL_DEPTH} levels")]
        except ValueError as exc:
            return text[:start].strip(), [ToolCall(error=f"the tool calls cannot be read ({exc})")]
        return text[:start].strip(), [_call_from(item) for item in items] if isinstance(items, list) else \
            [ToolCall(error='Mistral tool calls are a JSON list [{"name": ..., "arguments": {...}}]')]
    calls, rest = [], text
    while (match := MISTRAL_CALL.match(rest)) is not None:
        try:
            _, end = json.JSONDecoder().raw_decode(rest, match.end())
        except (ValueError, RecursionError):
            break
        calls.append(_parse_call(json.dumps({"name": match.group(1), "arguments": rest[match.end():end]})))
        rest = rest[end:].lstrip()
    return (text, []) if rest else ("", calls)


def _parse_call(body: str) -> ToolCall:
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(error=f"the tool call has {len(body)} characters; a call holds at most {MAX_CALL_CHARS}")
    try:
        data = _read_json(body)
    except json.JSONDecodeError as exc:
        return ToolCall(error=f"the tool call is not JSON ({exc.msg} at character {exc.pos})")
    except (RecursionError, _TooDeep):
        return ToolCall(error=f"the tool call nests deeper than {MAX_CALL_DEPTH} levels")
    except ValueError as exc:  # a number past Python's integer digit limit
        return ToolCall(error=f"the tool call cannot be read ({exc})")
    return _call_from(data)


def _call_from(data: Any) -> ToolCall:
    """The call a parsed JSON value holds (`parameters` read as `arguments`, Llama's name for them)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall(error='a tool call is {"name": <tool name>, "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _read_json(arguments, depth=1)
        except (RecursionError, ValueError, _TooDeep):  # JSONDecodeError is a ValueError: it stays a string
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=data["name"], error=f"the arguments of {data['name']} are not a JSON object")
    return ToolCall(name=data["name"], arguments=arguments)


class _TooDeep(Exception):
    """A parsed call nests deeper than MAX_CALL_DEPTH."""


def _read_json(text: str, depth: int = 0) -> Any:
    """`json.loads(text)`, refused (`_TooDeep`) when its objects and arrays nest deeper than MAX_CALL_DEPTH less
    `depth` (the levels already around it). The walk is iterative: it never recurses on what it checks."""
    value = json.loads(text)
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level >= MAX_CALL_DEPTH:
                raise _TooDeep
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


@dataclass(frozen=True)
class ToolResult:
    """A call's answer: the text the model reads (`content`) and whether it is an error."""

    name: str
    content: str
    error: bool

    def message(self) -> dict:
        """The `tool` message of the conversation."""
        return {"role": "tool", "name": self.name, "content": self.content}


def run_tool_call(tools: Mapping[str, Callable], call: ToolCall) -> ToolResult:
    """Run one parsed call; every failure is an error result whose text tells the model what went wrong."""
    if call.error is not None:
        return ToolResult(call.name, ERROR_PREFIX + call.error, True)
    fn = tools.get(call.name)
    if fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(call.name, f"{ERROR_PREFIX}there is no tool {call.name!r} (tools: {known})", True)
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolResult(call.name, f"{ERROR_PREFIX}{call.name}: {exc}", True)
    try:
        value = fn(**call.arguments)
        if inspect.isawaitable(value):
            value = run_awaitable(value)
    except Exception as exc:  # noqa: BLE001 - the model reads what the tool raised, the episode goes on
        return ToolResult(call.name, f"{ERROR_PREFIX}{call.name} raised {user_error(exc)}", True)
    if isinstance(value, str):
        return ToolResult(call.name, value, False)
    try:
        return ToolResult(call.name, json.dumps(value), False)
    except (TypeError, ValueError):
        return ToolResult(call.name, f"{ERROR_PREFIX}{call.name} returned a {type(value).__name__}, which is "
                                     "neither text nor JSON", True)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def tool_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for async tools, running in a daemon thread from the first async call on."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="async-tools", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run_awaitable(awaitable: Any) -> Any:
    """The result of `awaitable` (an async tool's call) run on `tool_loop()`, waited for in this thread; what it
    raises is raised here."""
    async def wait() -> Any:
        return await awaitable

    loop = tool_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # a tool on the loop calling a tool synchronously would wait on itself forever
        raise RuntimeError("a tool was called synchronously from the async tools' event loop; await it instead")
    return asyncio.run_coroutine_threadsafe(wait(), loop).result()
