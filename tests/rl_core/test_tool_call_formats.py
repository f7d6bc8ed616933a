"""Tool calls in the format the chat template teaches (rl_core.agents.tools.tool_call_format, parse_tool_calls,
docs/agents.md): Hermes/Qwen `<tool_call>` blocks, Llama 3.1-3.3's bare JSON, Mistral's `[TOOL_CALLS]` list and
`name{...}` forms; every malformed call an error the model reads, whatever the format."""

from __future__ import annotations

import json

import pytest

from rl_core.agents.episode import Episode
from rl_core.agents.tools import MAX_CALL_CHARS, MAX_CALL_DEPTH, ToolCall, parse_tool_calls, tool_call_format
from rl_core.model.loading import build_tiny_tokenizer
from tests.rl_core.test_agents import Sums, ids_of

# The lines by which each family's template shows its calls (Llama 3.1's tool prompt and built-in tool tag,
# Mistral's control token, Qwen2.5's blocks), as the published templates write them.
LLAMA = ('{{- "Given the following functions, please respond with a JSON for a function call with its proper '
         'arguments that best answers the given prompt.\\n\\n" }}{{- \'Respond in the format {"name": function '
         'name, "parameters": dictionary of argument name and its value}.\' }}'
         '{%- if builtin_tools %}<|python_tag|>{% endif %}')
MISTRAL = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}"
QWEN = "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' }}"


def test_the_format_is_the_one_the_template_teaches():
    assert tool_call_format(LLAMA) == "llama3_json"
    assert tool_call_format(MISTRAL) == "mistral"
    assert tool_call_format(QWEN) == "hermes"
    assert tool_call_format(None) == "hermes" and tool_call_format("{{ messages }}") == "hermes"
    assert tool_call_format({"default": "{{ messages }}", "tool_use": MISTRAL}) == "mistral"  # named templates


def call(name, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def test_llama_calls_are_a_turn_of_json_objects():
    one = '{"name": "calc", "parameters": {"x": "1+2"}}'
    assert parse_tool_calls(one, "llama3_json") == ("", [call("calc", x="1+2")])
    text = '{"name": "a", "parameters": {"s": "x;y}"}}; {"name": "b", "parameters": {}}'  # `;` inside a string stays
    assert parse_tool_calls(text, "llama3_json") == ("", [call("a", s="x;y}"), call("b")])
    assert parse_tool_calls(" The sum is 3.", "llama3_json") == ("The sum is 3.", [])
    [broken] = parse_tool_calls('{"name": "calc", "parameters": ', "llama3_json")[1]
    assert broken.error.startswith("the tool call is not JSON")


def test_mistral_calls_are_a_list_after_the_content_or_name_and_arguments():
    text = 'Let me add.[{"name": "calc", "arguments": {"x": "1+2"}}, {"name": "b", "arguments": {}}]'
    assert parse_tool_calls(text, "mistral") == ("Let me add.", [call("calc", x="1+2"), call("b")])
    named = 'calc{"x": "1+2"} b{"y": 1}'
    assert parse_tool_calls(named, "mistral") == ("", [call("calc", x="1+2"), call("b", y=1)])
    assert parse_tool_calls("The sum is {3}.", "mistral") == ("The sum is {3}.", [])
    [broken] = parse_tool_calls('[{"name": "calc", "arguments": {"x": ', "mistral")[1]
    assert broken.error.startswith("the tool calls are not JSON")
    [bad] = parse_tool_calls('[{"name": "calc", "arguments": 3}]', "mistral")[1]
    assert bad.error == "the arguments of calc are not a JSON object"


@pytest.mark.parametrize("style, wrap", [("llama3_json", "{}"), ("mistral", "[{}]"),
                                         ("hermes", "<tool_call>{}</tool_call>")])
def test_the_parsers_limits_hold_in_every_format(style, wrap):
    deep = '{"name": "f", "arguments": {"a": ' + "[" * (MAX_CALL_DEPTH + 5) + "]" * (MAX_CALL_DEPTH + 5) + "}}"
    long = json.dumps({"name": "f", "arguments": {"a": "x" * MAX_CALL_CHARS}})
    huge = '{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}"
    for body, says in ((deep, "deeper than"), (long, "characters"), (huge, "cannot be read")):
        _, [parsed] = parse_tool_calls(wrap.replace("{}", body, 1), style)
        assert parsed.error is not None and says in parsed.error, (style, parsed.error)
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("", "xml")


def test_an_episode_reads_its_turns_in_its_templates_format():
    llama = ("{{ bos_token }}{% if tools %}Respond in the format {\"name\": function name, \"parameters\": ...}\n"
             "{% endif %}"
             "{% for m in messages %}{% if m.role == 'assistant' %}assistant: {% if m.tool_calls %}"
             "{{ {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}"
             "{% else %}{{ m.content }}{% endif %}{{ eos_token }}\n"
             "{% elif m.role == 'tool' %}ipython: {{ m.content }}\n"
             "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = build_tiny_tokenizer()
    tok.chat_template = llama
    from rl_core.tasks import Example

    episode = Episode(Sums(Example("12+30", "42")), tok, max_turns=3, max_tokens=400)
    assert episode.tool_format == "llama3_json"
    ids = ids_of(tok, '{"name": "calculator", "parameters": {"expression": "12+30"}}') + [tok.eos_token_id]
    episode.add_turn(ids, [-0.5] * len(ids), stopped=True)
    assert episode.turns[0].calls == (call("calculator", expression="12+30"),)
    assert episode.messages[-1] == {"role": "tool", "name": "calculator", "content": "42"}
