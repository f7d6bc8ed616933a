"""GSM8K: the official JSONL (`question`, `answer`) from a local path, or the hub dataset by name.

`prepare_gsm8k(source, out_dir)` writes `out_dir/train.jsonl` and `out_dir/test.jsonl` in the
official format. `source` is a directory holding `train.jsonl` and `test.jsonl`, or a hub
dataset id (e.g. `openai/gsm8k`, loaded with the `datasets` library; it needs a reachable hub).
"""

from __future__ import annotations

from pathlib import Path

from rl_core.data.arithmetic import write_jsonl
from rl_core.data.jsonl import iter_jsonl, raise_row_errors, text_field

SPLITS = ("train", "test")
GSM8K_INSTRUCTION = (
    "Solve the problem step by step. End your answer with a final line of the form '#### <number>'."
)


def plain_prompt(question: str) -> str:
    """Prompt for base models: the model continues after 'Answer:'."""
    return f"Question: {question.strip()}\nAnswer:"


def read_gsm8k_jsonl(path: str | Path) -> list[dict]:
    """Records `{"question", "answer"}` of an official-format JSONL file."""
    records = []
    errors: list[str] = []  # every bad row, raised together
    for lineno, rec in iter_jsonl(path, "a GSM8K record {question, answer}", errors):
        try:
            if "question" not in rec or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: a GSM8K record needs 'question' and 'answer', got keys "
                                 f"{sorted(rec)}")
            records.append({"question": text_field(rec, "question", path, lineno),
                            "answer": text_field(rec, "answer", path, lineno, numbers=True), "row": f"{path}:{lineno}"})
        except ValueError as exc:
            errors.append(str(exc))
    raise_row_errors(errors)
    return records


def load_gsm8k_split(source: str | Path, split: str, config: str = "main") -> list[dict]:
    """One split (`train` | `test`) from a local directory / JSONL file or a hub dataset id (its `config`)."""
    if split not in SPLITS:
        raise ValueError(f"GSM8K split={split!r} is not one of {SPLITS}")
    path = Path(source)
    if path.is_dir():
        return read_gsm8k_jsonl(path / f"{split}.jsonl")
    if path.is_file():
        return read_gsm8k_jsonl(path)
    return _load_from_hub(str(source), split, config)


def _load_from_hub(name: str, split: str, config: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown id, ...
        raise RuntimeError(f"could not load GSM8K {name!r} split {split!r} from the hub: {exc}") from exc
    return [{"question": r["question"], "answer": r["answer"], "row": f"{name} ({split}) row {i}"}
            for i, r in enumerate(ds, 1)]


def prepare_gsm8k(source: str | Path, out_dir: str | Path) -> dict:
    """Write `out_dir/{train,test}.jsonl` (official fields); return paths and sizes."""
    out = Path(out_dir)
    result: dict = {}
    for split in SPLITS:
        records = load_gsm8k_split(source, split)
        if not records:
            raise ValueError(f"GSM8K {split} split from {source!r} is empty")
        official = [{"question": r["question"], "answer": r["answer"]} for r in records]
        result[split] = str(write_jsonl(official, out / f"{split}.jsonl"))
        result[f"n_{split}"] = len(records)
    return result
