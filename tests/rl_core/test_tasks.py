"""Tasks as plugins: the registry, the generic prompts task (JSONL, Parquet, a `datasets` directory), chat
rendering with a system prompt and instruction, and bad rows refused naming the file, row and column."""

from __future__ import annotations

import json
import re
from datetime import datetime
from decimal import Decimal

import pandas as pd
import pytest

from rl_core.config.schema import DataConfig
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.tasks import Example, Task, encode_prompts, format_prompt, get_task, load_examples

ROWS = [
    {"messages": [{"role": "user", "content": "12+34="}], "answer": "46", "max_chars": 2},
    {"messages": [{"role": "system", "content": "digits only"}, {"role": "user", "content": "1+2="}],
     "answer": "3", "max_chars": 1},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(**kw):
    return DataConfig(task="prompts", prompt_template="chat", **kw)


def test_the_registry_names_builtin_tasks_and_loads_yours_by_import_path():
    assert {get_task(n).name for n in ("arithmetic", "gsm8k", "prompts")} == {"arithmetic", "gsm8k", "prompts"}
    mine = get_task("tests.rl_core.test_tasks:ReversedTask")  # a subclass: instantiated
    assert isinstance(mine, ReversedTask)
    assert mine.plain_text(Example("abc"), None) == "cba"
    with pytest.raises(ValueError, match="data.task='chess' is not a built-in task"):
        get_task("chess")


class ReversedTask(Task):
    name = "reversed"

    def plain_text(self, example, data):
        return example.prompt[::-1]


def test_jsonl_parquet_and_a_datasets_directory_load_the_same_examples(tmp_path):
    source = _jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = tmp_path / "rows.parquet"
    pd.DataFrame(ROWS).to_parquet(parquet)
    directory = tmp_path / "dataset"
    directory.mkdir()
    _jsonl(directory / "train.jsonl", ROWS)  # `datasets.load_dataset(<dir>)` infers the format
    loaded = [load_examples(s, "prompts", chat()) for s in (source, parquet, directory)]
    first = loaded[0]
    assert [e.messages for e in first] == [tuple(r["messages"]) for r in ROWS]
    assert [dict(e.columns) for e in first] == [{"answer": "46", "max_chars": 2}, {"answer": "3", "max_chars": 1}]
    assert [e.prompt for e in first] == ["12+34=", "1+2="] and [e.answer for e in first] == ["46", "3"]
    assert first[1].row == f"{source}:2" and loaded[1][1].row == f"{parquet} row 2"
    for other in loaded[1:]:
        assert other == first and [dict(e.columns) for e in other] == [dict(e.columns) for e in first]


def test_chat_rendering_adds_the_system_prompt_and_instruction_once():
    tok = build_tiny_tokenizer()
    text = [Example("12+34=", "46")]
    messages = [Example("1+2=", "3", tuple(ROWS[1]["messages"]))]
    data = chat(system_prompt="Be exact.", instruction="Reply with digits.")
    assert format_prompt(text[0], tok, "prompts", "chat", data) == tok.apply_chat_template(
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "12+34=\nReply with digits."}],
        tokenize=False, add_generation_prompt=True)
    # a row with its own system message keeps it (no second system turn)
    assert format_prompt(messages[0], tok, "prompts", "chat", data) == tok.apply_chat_template(
        [{"role": "system", "content": "digits only"}, {"role": "user", "content": "1+2=\nReply with digits."}],
        tokenize=False, add_generation_prompt=True)
    plain = DataConfig(task="prompts", system_prompt="Be exact.", instruction="Digits:")
    assert format_prompt(text[0], tok, "prompts", "plain", plain) == "Be exact.\n12+34=\nDigits:"
    # no system prompt or instruction: the arithmetic quickstart's prompts are unchanged
    assert encode_prompts(tok, text, "arithmetic", "plain", DataConfig()) == [tok("12+34=")["input_ids"]]


def test_gsm8k_keeps_its_instruction_unless_one_is_given():
    tok = build_tiny_tokenizer()
    q = Example("Tom has 3 apples. How many?", "#### 3")
    own = format_prompt(q, tok, "gsm8k", "chat", DataConfig(task="gsm8k"))
    assert "#### <number>" in own
    mine = format_prompt(q, tok, "gsm8k", "chat", DataConfig(task="gsm8k", instruction="Box the answer."))
    assert "Box the answer." in mine and "#### <number>" not in mine


@pytest.mark.parametrize("rows, message", [
    ([{"answer": "1"}], r":1: no 'prompt' or 'messages' column \(got \['answer'\]\)"),
    ([{"prompt": "   ", "answer": "1"}], r":1: column 'prompt' is empty"),
    ([{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}], r":1: has both 'prompt' and 'messages'"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], r":2: column 'answer' is missing \(row .*:1 has it\)"),
    ([{"prompt": "a"}, {"prompt": "b", "extra": 1}], r":2: column 'extra' is not in row"),
    ([{"messages": []}], r":1: column 'messages' must be text or a non-empty list"),
    ([{"messages": "hi"}], r":1: column 'messages' must be a list of \{role, content\} messages, got text"),
    ([{"messages": [{"role": "user"}]}], r":1: column 'messages' message 0: must be"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], r":1: column 'messages' message 0: role 'robot'"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
     r":1: column 'messages': the last message is the assistant's"),
    ([{"messages": [{"role": "user", "content": " "}]}], r":1: column 'messages': the last user message is empty"),
    ([{"prompt": "a", "completions": "x"}], r":1: column 'completions' is reserved"),
])
def test_a_bad_row_is_refused_naming_the_file_row_and_column(tmp_path, rows, message):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + message):
        load_examples(path, "prompts", chat())


NOT_JSON = [  # a column's values (row 1 good, row 2 not), and what the refusal says of row 2
    ("answer", [46.0, float("nan")], "answer", "NaN is not a number JSON allows"),
    ("answer", [46.0, float("inf")], "answer", "Infinity is not a number JSON allows"),
    ("blob", [None, b"\x00\x01"], "blob", "a bytes value"),
    ("when", [None, datetime(2024, 1, 1)], "when", "a datetime value"),
    ("price", [None, Decimal("1.5")], "price", "a Decimal value"),
    ("meta", [None, {"score": float("-inf")}], "meta.score", "-Infinity is not a number JSON allows"),
]


@pytest.mark.parametrize("source", ["parquet", "datasets"])
@pytest.mark.parametrize("column, values, key, why", NOT_JSON, ids=["nan", "inf", "bytes", "timestamp", "decimal", "nested-inf"])
def test_parquet_and_datasets_rows_pass_the_value_checks_of_jsonl(tmp_path, source, column, values, key, why):
    """Issue 44, finding 8: Parquet and `datasets` rows took NaN, infinity, bytes and timestamps that a JSONL line
    is refused for (a NaN answer became the text "nan"). Each is refused naming the file, the row and the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path / "dataset"
    directory.mkdir()
    parquet = directory / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "3+4="], column: values}), parquet)
    where = f"{parquet} row 2" if source == "parquet" else f"{directory} (train) row 2"
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: column {key!r}: {re.escape(why)}.*convert or drop"):
        load_examples(parquet if source == "parquet" else directory, "prompts", chat())


def test_a_parquet_null_is_none_and_its_numbers_keep_their_type(tmp_path):
    """Arrow's own values: a null in a number column is None (not NaN, which is refused), an int stays an int."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "3+4="], "answer": [3, None], "max_chars": [1, None]}), parquet)
    rows = load_examples(parquet, "prompts", chat())
    assert [dict(e.columns) for e in rows] == [{"answer": 3, "max_chars": 1}, {"answer": None, "max_chars": None}]
    assert [e.answer for e in rows] == ["3", ""] and type(rows[0].columns["max_chars"]) is int


def test_value_problem_walks_deep_values_without_recursion():
    from rl_core.data.jsonl import MAX_NESTING, value_problem

    deep: object = "x"
    for _ in range(100_000):
        deep = [deep]
    assert value_problem({"prompt": "a", "deep": deep}) == ("deep" + ".0" * (MAX_NESTING - 1),
                                                            f"nested more than {MAX_NESTING} levels deep")
    shallow: object = "x"
    for _ in range(MAX_NESTING - 1):  # a line of this record is MAX_NESTING deep: what JSONL allows
        shallow = [shallow]
    assert value_problem({"ok": shallow, "n": 10**99, "t": True}) is None
    assert value_problem({"n": 10**100}) == ("n", "a number of more than 100 digits")
    assert value_problem({"m": {1: "a"}}) == ("m", "a mapping with a key that is not text (1)")


def test_chat_rows_are_detected_unless_the_template_is_set(tmp_path):
    """TRL's conversational rows: under data.prompt_template=auto (the default) a prompt of messages is rendered with
    the chat template and a text prompt as it is; plain refuses chat rows; chat renders a text prompt as the user's
    turn; auto refuses a mix, which would render one run's prompts two ways."""
    tok = build_tiny_tokenizer()
    assert DataConfig().prompt_template == "auto"
    path = _jsonl(tmp_path / "rows.jsonl", ROWS)
    auto = DataConfig(task="prompts")
    rows = load_examples(path, "prompts", auto)
    as_chat = encode_prompts(tok, rows, "prompts", "chat", auto)
    assert encode_prompts(tok, rows, "prompts", auto.prompt_template, auto) == as_chat
    assert format_prompt(rows[0], tok, "prompts", "auto", auto) == format_prompt(rows[0], tok, "prompts", "chat", auto)
    text = [Example("12+34=", "46", row="t.jsonl:1")]
    plain = encode_prompts(tok, text, "prompts", "plain")
    assert encode_prompts(tok, text, "prompts", "auto") == plain != encode_prompts(tok, text, "prompts", "chat")
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: a chat-format prompt \(messages\) under "
                                         r"data\.prompt_template=plain"):
        load_examples(path, "prompts", DataConfig(task="prompts", prompt_template="plain"))
    with pytest.raises(ValueError, match=r"rows\.jsonl:1 has a chat-format prompt \(messages\) and t\.jsonl:1 a "
                                         r"text prompt: data\.prompt_template=auto renders"):
        encode_prompts(tok, rows + text, "prompts", "auto", auto)
    assert encode_prompts(tok, rows + text, "prompts", "chat", auto)[-1:] == encode_prompts(tok, text, "prompts", "chat")


def test_auto_renders_an_environments_episodes_as_chat():
    from rl_core.tasks import row_template

    env = get_task("tests.rl_core.test_agents:Chatter")
    assert row_template(Example("7"), env, "auto") == "chat"
    assert row_template(Example("7"), get_task("arithmetic"), "auto") == "plain"
    assert row_template(Example("7"), env, "plain") == "plain"  # preflight refuses it (tests/rl_core/test_agents.py)


def test_preflight_names_a_task_without_rewards_and_unread_keys():
    from rl_core.config import load_config
    from rl_core.preflight.rules import preflight

    def problems(*overrides):
        return preflight(load_config("recipes/arithmetic.py", list(overrides))).errors

    assert any("data.task='prompts' has no reward of its own; list yours in data.rewards" in e
               for e in problems("data.task=prompts"))
    assert any(e.startswith("data.reward_mode='flexible'") for e in problems("data.reward_mode=flexible"))
    two = "data.rewards=[{path: 'examples.own_data:exact_answer'}, {path: 'examples.own_data:exact_answer'}]"
    assert any("data.rewards[1]: a second reward named 'exact_answer'" in e for e in problems(two))
    assert not problems("data.rewards=[{path: 'examples.own_data:exact_answer', weight: 2}]")
