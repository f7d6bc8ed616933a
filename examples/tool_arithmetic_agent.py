"""The tool-arithmetic job written as an agent with the plain `openai` client (docs/agents.md, "Bring your own
agent"; recipes/tool_arithmetic_agent.py trains it): the same rows, tool and reward as `examples.tool_arithmetic`,
whose environment class posttrain drives, but here the agent drives the conversation and posttrain serves the
model behind its client.

`calculator_agent(client, row)` is ordinary agent code: it asks the model, runs the calculator when the model calls
it, sends the result back, and scores the final answer. `async_calculator_agent` is the same agent on
`openai.AsyncOpenAI`.
"""

from __future__ import annotations

import json
from typing import Any

from examples.tool_arithmetic import calculator
from rl_core.agents.tools import tool_schema

TOOLS = [tool_schema(calculator)]  # {"type": "function", "function": {"name": "calculator", ...}}
MAX_TURNS = 3


def _run_calls(message: Any) -> list[dict]:
    """The calculator's answer to each call of `message` (an error's text when it fails)."""
    results = []
    for call in message.tool_calls:
        try:
            content = calculator(**json.loads(call.function.arguments)) if call.function.name == "calculator" \
                else f"error: no tool {call.function.name!r}"
        except (TypeError, ValueError) as exc:
            content = f"error: {exc}"
        results.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return results


def _assistant(message: Any) -> dict:
    return message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)


def calculator_agent(client: Any, row: dict) -> float:
    """One sum: 1.0 when the model's final answer is exactly `row["answer"]`."""
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(_assistant(message))
        if not message.tool_calls:
            return float((message.content or "").strip() == row["answer"])
        messages += _run_calls(message)
    return 0.0


async def async_calculator_agent(client: Any, row: dict) -> float:
    """`calculator_agent` on the async client, streaming each answer."""
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
        content, calls = "", {}
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                  "function": {"name": call.function.name, "arguments": ""}})
                    calls[call.index]["function"]["arguments"] += call.function.arguments or ""
        messages.append({"role": "assistant", "content": content or None,
                         **({"tool_calls": list(calls.values())} if calls else {})})
        if not calls:
            return float(content.strip() == row["answer"])
        for call in calls.values():
            try:
                result = calculator(**json.loads(call["function"]["arguments"]))
            except (TypeError, ValueError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 0.0


async def sdk_calculator_agent(client: Any, row: dict) -> float:
    """The same agent written with the OpenAI Agents SDK (`pip install openai-agents`): an `Agent` with the calculator
    as a function tool, run by the SDK's own loop on the Chat Completions API of `client`."""
    from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  tools=[function_tool(calculator)])
    try:  # the SDK sends its traces to OpenAI unless they are disabled
        result = await Runner.run(agent, row["prompt"], max_turns=MAX_TURNS, run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        return 0.0
    return float(str(result.final_output).strip() == row["answer"])
