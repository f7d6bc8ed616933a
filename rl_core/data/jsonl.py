"""Reading JSONL data files line by line, with errors that name the file and the line; the same value rules for
rows of any other source (`value_problem`: Parquet, a `datasets` dataset). A loader that reads on past a bad row
collects every one and raises `RowErrors` listing them all."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

# Numbers beyond these are refused with the file, line and key (Python's int() refuses > 4300 digits, with no
# position; a float literal of 400 digits is infinity): no answer or field of a data file needs more.
MAX_NUMBER_CHARS = 100
# Deeper nesting than this is refused: a data record is an object of strings and numbers; json's parser recurses
# once per level and raised an uncaught RecursionError at ~100k.
MAX_NESTING = 64


class RowErrors(ValueError):
    """Every bad row of one data split, each message naming the file and row (`.problems`, in file order); the text
    is the messages, one a line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def raise_row_errors(problems: list[str]) -> None:
    """`RowErrors(problems)` when there are any."""
    if problems:
        raise RowErrors(problems)


class _Bad:
    """A value the parser met that is not allowed (NaN, Infinity, a huge number): reported with its key."""

    def __init__(self, text: str, why: str):
        self.text, self.why = text, why


def _constant(text: str) -> _Bad:
    return _Bad(text, f"{text} is not a number JSON allows")


def _integer(text: str) -> int | _Bad:
    return _Bad(text[:20] + "...", f"a number of {len(text)} digits") if len(text) > MAX_NUMBER_CHARS else int(text)


def _real(text: str) -> float | _Bad:
    if len(text) > MAX_NUMBER_CHARS:
        return _Bad(text[:20] + "...", f"a number of {len(text)} characters")
    value = float(text)
    return value if math.isfinite(value) else _Bad(text, f"{text} overflows to infinity")


def _object(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


class _Duplicate(Exception):
    def __init__(self, key: str):
        self.key = key


def _depth(line: str) -> int:
    """The deepest nesting of `[`/`{` outside strings (a linear scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in line:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _find_bad(node: object, key: str = "") -> tuple[str, _Bad] | None:
    if isinstance(node, _Bad):
        return key, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        found = _find_bad(v, f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


def value_problem(record: dict) -> tuple[str, str] | None:
    """`(key, why)` of the first value of a row that a JSONL line could not hold, else None: what every data source's
    rows must be, JSONL's parser enforcing it as it reads. Text, true/false, null, finite numbers of at most
    `MAX_NUMBER_CHARS` digits, and lists and mappings (text keys) of them nested at most `MAX_NESTING` deep; not
    NaN or infinity, bytes, timestamps, decimals or any other object. `key` is dotted (`meta.tags.0`)."""
    stack: list[tuple[str, object, int]] = [(str(k), v, 1) for k, v in reversed(record.items())]
    while stack:  # no recursion: a deep value is refused, never a RecursionError
        key, value, depth = stack.pop()
        if value is None or isinstance(value, (str, bool)):
            continue
        if isinstance(value, int):
            if abs(value) >= 10 ** MAX_NUMBER_CHARS:
                return key, f"a number of more than {MAX_NUMBER_CHARS} digits"
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                text = "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
                return key, f"{text} is not a number JSON allows"
            continue
        if isinstance(value, (list, tuple, dict)):
            if depth >= MAX_NESTING:
                return key, f"nested more than {MAX_NESTING} levels deep"
            if isinstance(value, dict):
                if bad := [k for k in value if not isinstance(k, str)]:
                    return key, f"a mapping with a key that is not text ({bad[0]!r:.40})"
                items = list(value.items())
            else:
                items = list(enumerate(value))
            stack.extend((f"{key}.{k}", v, depth + 1) for k, v in reversed(items))
            continue
        return key, (f"a {type(value).__name__} value ({value!r:.40}) is not text, a number, true/false, null, a list "
                     "or a mapping")
    return None


def iter_jsonl(path: str | Path, what: str, errors: list[str] | None = None) -> Iterator[tuple[int, dict]]:
    """`(line number, record)` for every non-blank line of a JSONL file.

    A line that is not a JSON object raises ValueError `"<path>:<line>: not a JSON object (...)"`;
    `what` names the records in that message (e.g. "an arithmetic example"). So does a record with a
    duplicate key, NaN or Infinity, a number of more than `MAX_NUMBER_CHARS` characters (naming the
    key), or nesting deeper than `MAX_NESTING`. A directory given as the file is named as one.
    With `errors`, a bad line's message is appended to it instead and the line skipped: the reader goes on.
    """
    if Path(path).is_dir():
        raise ValueError(f"{path}: is a directory, not a JSONL file; give the file ({what} per line)")
    with open(path, "rb") as fh:  # bytes, decoded line by line: a bad byte is named by its line
        for lineno, raw in enumerate(fh, 1):
            try:
                record = _parse_line(path, lineno, raw, what)
            except ValueError as exc:
                if errors is None:
                    raise
                errors.append(str(exc))
                continue
            if record is not None:
                yield lineno, record


def _parse_line(path: str | Path, lineno: int, raw: bytes, what: str) -> dict | None:
    """The record of one line (None: a blank line), or a ValueError naming the file and line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                         "re-save the file as UTF-8") from None
    if not line.strip():
        return None
    if (depth := _depth(line)) > MAX_NESTING:
        raise ValueError(f"{path}:{lineno}: nested {depth} levels deep (at most {MAX_NESTING}); each line "
                         f"holds {what}")
    try:
        record = json.loads(line, object_pairs_hook=_object, parse_constant=_constant, parse_int=_integer,
                            parse_float=_real)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg}); each line holds {what}") from None
    except _Duplicate as dup:
        raise ValueError(f"{path}:{lineno}: key {dup.key!r} appears twice; keep one") from None
    if not isinstance(record, dict):  # bad input data: a ValueError, like every data-file error
        kind = type(record).__name__
        raise ValueError(f"{path}:{lineno}: not a JSON object (a {kind}); each line holds {what}")  # noqa: TRY004
    if found := _find_bad(record):
        key, bad = found
        raise ValueError(f"{path}:{lineno}: key {key!r}: {bad.why} ({bad.text}); write a finite number of "
                         f"at most {MAX_NUMBER_CHARS} characters")
    return record


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
