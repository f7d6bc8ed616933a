"""Your own data and rewards (docs/data.md walks through this file; recipes/own_data_lora.py trains with it).

The data: chat-format JSONL rows, one per problem,

    {"messages": [{"role": "user", "content": "12+34="}], "answer": "46", "max_chars": 2}

written by `make_rows` (`posttrain`'s DVC stage `own_data` runs `python -m examples.own_data --out
data/own-data`). Every column but `messages` reaches the reward functions as a keyword argument.

The rewards, TRL-style: `answer_digits` reads the `answer` column (partial credit per digit in place),
`within_length` the `max_chars` column; the recipe weighs them 0.8 and 0.2. `answer_digits` comes first, so it is
the success reward: the held-out `val/accuracy` counts completions it gives 1.0, those exactly the answer.
`exact_answer` is the all-or-nothing version. `verl_style` shows a verl `compute_score` wrapped in one line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _text(completion) -> str:
    """A completion's text: chat-format rows give `[{"role": "assistant", "content": text}]`."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(completions, answer, **_):
    """1.0 when the completion is exactly the answer (whitespace aside), else 0.0."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def answer_digits(completions, answer, **_):
    """Partial credit: the fraction of the answer's digits the completion has in place (1.0: exactly the answer)."""
    out = []
    for c, a in zip(completions, answer):
        got, want = _text(c).strip(), str(a).strip()
        same = sum(x == y for x, y in zip(got, want))
        out.append(same / max(len(got), len(want)) if got else 0.0)
    return out


def within_length(completions, max_chars, **_):
    """1.0 when the completion is non-empty and at most the row's `max_chars` characters, else 0.0."""
    return [float(0 < len(_text(c).strip()) <= int(m)) for c, m in zip(completions, max_chars)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A verl-style scorer, as a team may already have one."""
    return float(solution_str.strip() == str(ground_truth).strip())


def verl_style(prompts, completions, answer, **_):
    return [compute_score("own_data", _text(c), a) for c, a in zip(completions, answer)]


def make_rows(seed: int = 0, train_size: int = 2000, val_size: int = 200) -> tuple[list[dict], list[dict]]:
    """Two-digit sums in chat format, shuffled with `seed`; the held-out rows are disjoint from the train rows."""
    import random

    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
             "max_chars": len(str(a + b))} for a, b in pairs[: val_size + train_size]]
    return rows[val_size:], rows[:val_size]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the own-data example's train.jsonl and val.jsonl")
    parser.add_argument("--out", default="data/own-data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = make_rows(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(val)} held-out rows to {out}/")


if __name__ == "__main__":
    main()
