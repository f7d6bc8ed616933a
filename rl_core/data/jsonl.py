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
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
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
