"""GSM8K reward: compare the completion's final number with the dataset answer, exactly.

`answer` is the dataset's answer field (reasoning ending in `#### N`) or just `N`.

- strict: the number of the LAST `#### N` in the completion (a `####` with no number after it is
  skipped over; no `#### N` at all scores 0).
- flexible: the last number anywhere in the completion.

No truncation window: the whole completion is searched (a tail window silently zeroed answers
followed by more text elsewhere, verl #7274). Numbers are normalised — thousands commas, `$`,
a trailing sentence `.`, a leading `-` (or U+2212) — and compared exactly as `Decimal`s, so
`18`, `18.0`, `$18.` and `18.00` agree while `18.01` does not. An empty or number-free
completion, or an answer with no number, never scores.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign (before or after `$`), thousands-grouped or plain digits, optional decimals.
# The gaps around `$` are bounded (at most 3 whitespace characters each): with unbounded `\s*` the two
# gaps make every start position try every split of a whitespace run, which is cubic in its length;
# bounded, the work per position is constant and a completion is scored in linear time. A sign more
# than 3 spaces away from its number does not count.
_GAP = r"\s{0,3}"
_NUMBER = (
    r"(?P<sign>[-\u2212]?)" + _GAP + r"\$?" + _GAP
    + r"(?P<sign2>[-\u2212]?)(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
)
_NUMBER_RE = re.compile(r"(?<!\d)" + _NUMBER)
_STRICT_RE = re.compile(r"####\s*+" + _NUMBER)  # possessive: the run after #### is consumed once


def _to_decimal(match: re.Match) -> Decimal | None:
    negative = bool(match.group("sign")) != bool(match.group("sign2"))
    text = match.group("num").replace(",", "")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return -value if negative else value


def extract_strict(text: str) -> Decimal | None:
    """Number of the last `#### N` in `text`, or None."""
    matches = list(_STRICT_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def extract_flexible(text: str) -> Decimal | None:
    """Last number anywhere in `text`, or None."""
    matches = list(_NUMBER_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def extract_reference(answer: str) -> Decimal | None:
    """The dataset answer's number: after its last `####`, or the answer itself when it has none."""
    answer = str(answer)
    if "####" in answer:
        return extract_strict(answer)
    return extract_flexible(answer)


def gsm8k_reward(completion: str, answer: str, mode: str = "strict") -> float:
    """1.0 when the completion's answer (per `mode`) equals the reference number exactly, else 0.0."""
    if mode == "strict":
        got = extract_strict(completion)
    elif mode == "flexible":
        got = extract_flexible(completion)
    else:
        raise ValueError(f"gsm8k reward mode={mode!r} is not one of 'strict', 'flexible'")
    expected = extract_reference(answer)
    if got is None or expected is None:
        return 0.0
    return 1.0 if got == expected else 0.0
