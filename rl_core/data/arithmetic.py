"""Arithmetic data: every `a<op>b=` over an operand range, split into train and held-out by seed.

A record is `{"prompt": "12+34=", "answer": "46"}`. All pairs `(a, b)` in `[low, high]²` for each
operator are enumerated, shuffled with the seed, and the first `val_size` become the held-out
split, the next `train_size` (default: all the rest) the train split — disjoint by construction.
"""

from __future__ import annotations

import json
import operator
from pathlib import Path

import numpy as np

from rl_core.atomic import write_text_atomic

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_examples(low: int = 0, high: int = 99, operators: tuple[str, ...] = ("+",)) -> list[dict]:
    """Every problem in the range, in a fixed order (operator, then a, then b)."""
    if low > high:
        raise ValueError(f"operand range low={low} > high={high}")
    unknown = [op for op in operators if op not in _OPS]
    if unknown or not operators:
        raise ValueError(f"operators={list(operators)} must be a non-empty subset of {sorted(_OPS)}")
    out = []
    for op in dict.fromkeys(operators):
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                out.append({"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))})
    return out


def split_arithmetic(
    seed: int,
    *,
    low: int = 0,
    high: int = 99,
    operators: tuple[str, ...] = ("+",),
    val_size: int = 500,
    train_size: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """`(train, val)`: a seeded shuffle of all problems, val first, disjoint."""
    examples = arithmetic_examples(low, high, operators)
    if val_size < 1 or val_size >= len(examples):
        raise ValueError(
            f"val_size={val_size} must be in [1, {len(examples) - 1}] for {len(examples)} problems"
        )
    order = np.random.default_rng([int(seed), 0xA417]).permutation(len(examples))
    shuffled = [examples[i] for i in order]
    val = shuffled[:val_size]
    rest = shuffled[val_size:]
    if train_size is not None:
        if train_size < 1 or train_size > len(rest):
            raise ValueError(f"train_size={train_size} must be in [1, {len(rest)}]")
        rest = rest[:train_size]
    return rest, val


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Write one JSON record per line, atomically (a reader sees the old file or the whole new one)."""
    return write_text_atomic(path, "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records))


def make_arithmetic_data(out_dir: str | Path, seed: int = 0, **split_kwargs) -> dict:
    """Write `out_dir/train.jsonl` and `out_dir/val.jsonl`; return paths and sizes."""
    train, val = split_arithmetic(seed, **split_kwargs)
    out = Path(out_dir)
    return {
        "train": str(write_jsonl(train, out / "train.jsonl")),
        "val": str(write_jsonl(val, out / "val.jsonl")),
        "n_train": len(train),
        "n_val": len(val),
    }
