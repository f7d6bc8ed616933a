"""The generic task: your prompts, from a JSONL or Parquet file or a Hugging Face `datasets` dataset.

`data.task=prompts`. Each row has either

- `prompt`: the prompt text (rendered with `data.prompt_template`), or a list of chat messages, or
- `messages`: a list of `{"role", "content"}` chat messages ending with the user's turn (rendered with
  the tokenizer's chat template: `data.prompt_template=auto`, the default, or `chat`; `plain` refuses them),

and any other columns, which the reward functions receive as keyword arguments (`answer=[...]`,
`data_source=[...]`, ...), one value per completion. `data.system_prompt` and `data.instruction` are
added to every prompt. The source (`data.train` / `data.val`) is

- a `.jsonl` file (one JSON object per line) or a `.parquet` file,
- a local directory or a hub dataset id, loaded with `datasets.load_dataset(source, data.dataset_config,
  split=...)`; the split follows a colon, `my-org/my-data:validation` (default `train`).

A bad row (no prompt, an empty one, malformed messages, a column other rows have missing) is refused while
the data is loaded, before anything is placed or trained, naming the file, the row and the column; every bad
row of the split is named at once (`rl_core.data.jsonl.RowErrors`). So is a
value that a JSONL line could not hold, whatever the source (`rl_core.data.jsonl.value_problem`): NaN or
infinity, bytes, a timestamp, a decimal, nesting deeper than 64 levels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_core.data.jsonl import iter_jsonl, raise_row_errors, value_problem
from rl_core.tasks.base import Example, Task

ROLES = ("system", "user", "assistant")
PROMPT_COLUMNS = ("prompt", "messages")
RESERVED = ("prompts", "completions")  # the reward functions' own arguments


class PromptsTask(Task):
    name = "prompts"

    def load(self, source: str, data: Any) -> list[Example]:
        """Every row checked: the bad ones all raise together (`RowErrors`, in file order)."""
        errors: list[str] = []
        examples: list[Example] = []
        first_where, expected = "", None
        for where, record in _read_rows(str(source), getattr(data, "dataset_config", None), errors):
            if expected is None:
                first_where, expected = where, set(record)
            try:
                _check_row(where, record, first_where, expected)
                examples.append(_example(where, record))
            except ValueError as exc:
                errors.append(str(exc))
        template = getattr(data, "prompt_template", "auto")
        if template == "plain" and (chat := next((e for e in examples if e.messages is not None), None)):
            errors.append(f"{chat.row}: a chat-format prompt (messages) under data.prompt_template=plain, which "
                          "renders text only; set data.prompt_template=auto (the default) or chat, which render "
                          "it with the tokenizer's chat template")
        raise_row_errors(errors)
        return examples


def _check_row(where: str, record: dict, first_where: str, expected: set[str]) -> None:
    if problem := value_problem(record):
        key, why = problem
        raise ValueError(f"{where}: column {key!r}: {why}; every value is text, a finite number, true/false, "
                         "null, or a list or mapping of them: convert or drop it in the source")
    if missing := sorted(expected - set(record)):
        raise ValueError(f"{where}: column {missing[0]!r} is missing (row {first_where} has it); "
                         "give every row the same columns")
    if extra := sorted(set(record) - expected):
        raise ValueError(f"{where}: column {extra[0]!r} is not in row {first_where}; give every row the "
                         "same columns")


def _read_rows(source: str, config: str | None, errors: list[str] | None = None):
    """`(where, record)` for every row of the source, `where` naming the file and row; a JSONL line that is no
    record goes to `errors` (raised when None)."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        for lineno, record in iter_jsonl(path, "a prompt row {prompt or messages, ...}", errors):
            yield f"{path}:{lineno}", record
        return
    if path.is_file() and path.suffix == ".parquet":
        import pyarrow.parquet as pq

        # Arrow's own values: a null is None (pandas would make it NaN in a number column), a list a list
        for i, record in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {i}", record
        return
    if path.is_file():
        raise ValueError(f"{path}: a prompt dataset file is .jsonl or .parquet (or give a directory / hub dataset "
                         "id that the `datasets` library loads)")
    name, sep, split = source.rpartition(":")
    if path.exists() or not sep:  # a local directory, or an id without a split
        name, split = source, ""
    import datasets

    try:
        table = datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, no such split: say which source
        raise ValueError(f"{source!r}: the `datasets` library could not load it (config={config!r}, "
                         f"split={split or 'train'!r}): {type(exc).__name__}: {exc}") from None
    for i, record in enumerate(table, 1):
        yield f"{name} ({split or 'train'}) row {i}", record


def _example(where: str, record: dict) -> Example:
    present = [c for c in PROMPT_COLUMNS if record.get(c) is not None]
    if not present:
        raise ValueError(f"{where}: no 'prompt' or 'messages' column (got {sorted(record)}); give each row its "
                         "prompt text in 'prompt' or its chat messages in 'messages'")
    if len(present) == 2:
        raise ValueError(f"{where}: has both 'prompt' and 'messages'; keep one")
    if reserved := [c for c in RESERVED if c in record]:
        raise ValueError(f"{where}: column {reserved[0]!r} is reserved (the reward functions' {reserved[0]} argument); "
                         "rename it")
    column = present[0]
    value = record[column]
    columns = {k: v for k, v in record.items() if k not in PROMPT_COLUMNS}
    answer = columns.get("answer")
    answer = "" if answer is None else str(answer)
    if isinstance(value, str):
        if column == "messages":
            raise ValueError(f"{where}: column 'messages' must be a list of {{role, content}} messages, got text; "
                             "put plain text in 'prompt'")
        if not value.strip():
            raise ValueError(f"{where}: column 'prompt' is empty; write the prompt, or drop the row")
        return Example(value, answer, None, columns, where)
    messages = _messages(where, column, value)
    return Example(messages[-1]["content"], answer, messages, columns, where)


def _messages(where: str, column: str, value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        kind = "an empty list" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{where}: column {column!r} must be text or a non-empty list of {{role, content}} "
                         f"messages, got {kind}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):  # bad data: a ValueError like every data error
            raise ValueError(  # noqa: TRY004
                f"{where}: column {column!r} message {i}: must be {{\"role\": text, \"content\": text}}, "
                f"got {message!r:.80}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: column {column!r} message {i}: role {message['role']!r} is not one of "
                             f"{', '.join(ROLES)}")
        out.append({"role": message["role"], "content": message["content"]})
    if out[-1]["role"] != "user":
        raise ValueError(f"{where}: column {column!r}: the last message is the {out[-1]['role']}'s; a prompt ends with "
                         "the user's turn (the model writes the assistant's)")
    if not out[-1]["content"].strip():
        raise ValueError(f"{where}: column {column!r}: the last user message is empty")
    return tuple(out)
