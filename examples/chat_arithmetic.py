"""Chat data as a TRL user brings it: the conversational example (recipes/chat_arithmetic.py, docs/data.md).

The rows are in TRL's conversational prompt format, one two-digit sum each,

    {"prompt": [{"role": "system", "content": "Reply with the sum only."},
                {"role": "user", "content": "What is 12+34?"}],
     "solution": "46", "difficulty": "easy"}

and the rewards are written as TRL writes them: `accuracy_reward(completions, solution, **kwargs)` (1.0 for the
exact sum) and `format_reward(completions, **kwargs)` (1.0 for digits only), weighted 1.0 and 0.2 by the recipe.
`data.success_reward` names `accuracy_reward`, so the held-out accuracy counts exact sums whatever the weights.

The tiny model learned sums from plain prompts (`12+34=`); the chat warm start (`artifacts/tiny-model/chat`,
`pipelines/chat_arithmetic/dvc.yaml`) trains it briefly on whole conversations of this form
(`warm-train.jsonl`: the prompt's messages and the assistant's answer), so it knows the turn format and part of
the skill in it, and RL has the rest to learn. `python -m examples.chat_arithmetic --out data/chat-arithmetic`
writes `train.jsonl`, `val.jsonl`, `warm-train.jsonl` and `warm-val.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SYSTEM = "Reply with the sum only."
DIGITS = re.compile(r"\d+")


def _text(completion) -> str:
    """A completion's text: conversational rows give `[{"role": "assistant", "content": text}]`."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def accuracy_reward(completions, solution, **kwargs):
    """1.0 when the completion is exactly the solution (whitespace aside), else 0.0."""
    return [float(_text(c).strip() == str(s).strip()) for c, s in zip(completions, solution)]


def format_reward(completions, **kwargs):
    """1.0 when the completion is a number and nothing else, else 0.0."""
    return [float(DIGITS.fullmatch(_text(c).strip()) is not None) for c in completions]


def prompt_messages(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]


def make_rows(seed: int = 0, train_size: int = 2000, val_size: int = 200) -> dict[str, list[dict]]:
    """The four splits, shuffled with `seed`. RL's held-out rows are disjoint from its train rows and from every
    conversation of the warm start; the warm start's rows are a part of RL's train rows (its held-out ones too)."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": prompt_messages(a, b), "solution": str(a + b),
             "difficulty": "easy" if a + b < 100 else "hard"} for a, b in pairs[: val_size + train_size]]
    val, train = rows[:val_size], rows[val_size:]
    conversations = [{"messages": [*r["prompt"], {"role": "assistant", "content": r["solution"]}]} for r in train]
    return {"train": train, "val": val, "warm-train": conversations[100:], "warm-val": conversations[:100]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write the chat example's RL splits and its warm start's conversations")
    parser.add_argument("--out", default="data/chat-arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_rows(args.seed)
    for name, rows in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {', '.join(f'{name}.jsonl ({len(rows)} rows)' for name, rows in splits.items())} to {out}/")


if __name__ == "__main__":
    main()
