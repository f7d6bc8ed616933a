"""Reading JSONL data files line by line, with errors that name the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path, what: str) -> Iterator[tuple[int, dict]]:
    """`(line number, record)` for every non-blank line of a JSONL file.

    A line that is not a JSON object raises ValueError `"<path>:<line>: not a JSON object (...)"`;
    `what` names the records in that message (e.g. "an arithmetic example").
    """
    with open(path, "rb") as fh:  # bytes, decoded line by line: a bad byte is named by its line
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                                 "re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg}); each line holds {what}") from None
            if not isinstance(record, dict):  # bad input data: a ValueError, like every data-file error
                kind = type(record).__name__
                raise ValueError(f"{path}:{lineno}: not a JSON object (a {kind}); each line holds {what}")  # noqa: TRY004
            yield lineno, record


def text_field(record: dict, key: str, path: str | Path, lineno: int, *, numbers: bool = False) -> str:
    """`record[key]` as text: a non-empty string (or, with `numbers`, a number), else a ValueError naming the row."""
    value = record.get(key)
    if isinstance(value, bool) or not (isinstance(value, str) or (numbers and isinstance(value, (int, float)))):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{path}:{lineno}: {key!r} must be {'text or a number' if numbers else 'text'}, got {kind}")
    text = str(value)
    if not text.strip():
        raise ValueError(f"{path}:{lineno}: {key!r} is empty")
    return text
