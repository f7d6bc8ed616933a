"""Datasets (arithmetic, GSM8K), prompt templates and the seeded prompt sampler.

An `Example` is `(prompt, answer)`: for arithmetic the prompt is `"12+34="` and the answer
`"46"`; for GSM8K the prompt is the question and the answer the official answer field (ending
`#### N`), which the GSM8K reward parses. `encode_prompts` turns examples into the token ids the
rollout engine takes, with the configured template:

- plain: arithmetic prompts as they are; GSM8K as `Question: ...\\nAnswer:`; tokenised with the
  tokenizer's own special tokens (e.g. the tiny model's `<bos>`).
- chat: the tokenizer's chat template with a generation prompt (GSM8K adds an instruction to end
  with `#### <number>`); the template supplies its own special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rl_core.data.arithmetic import make_arithmetic_data, split_arithmetic
from rl_core.data.gsm8k import chat_messages, load_gsm8k_split, plain_prompt, prepare_gsm8k
from rl_core.data.jsonl import iter_jsonl, text_field
from rl_core.data.sampler import PromptSampler


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def load_examples(source: str | Path, task: str) -> list[Example]:
    """Examples of a JSONL split (arithmetic: `prompt`/`answer`; GSM8K: `question`/`answer`).

    GSM8K also accepts a hub id with an optional split, `openai/gsm8k:test` (default `train`).
    """
    path = Path(source)
    if task == "gsm8k":
        if path.exists():
            records = load_gsm8k_split(path, "train")  # a file path: the split is the file
        else:
            name, _, split = str(source).partition(":")
            records = load_gsm8k_split(name, split or "train")
        return [Example(r["question"], r["answer"]) for r in records]
    if task == "arithmetic":
        if not path.exists():
            raise FileNotFoundError(
                f"arithmetic split {str(source)!r} does not exist; build it with "
                "`posttrain make-data arithmetic --out data/arithmetic`"
            )
        out = []
        for lineno, rec in iter_jsonl(path, "an arithmetic example {prompt, answer}"):
            if "prompt" not in rec or "answer" not in rec:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' and 'answer', got keys {sorted(rec)}")
            out.append(Example(text_field(rec, "prompt", path, lineno), text_field(rec, "answer", path, lineno,
                                                                                   numbers=True)))
        return out
    raise ValueError(f"data.task={task!r} is not one of 'arithmetic', 'gsm8k'")


def _messages(example: Example, task: str) -> list[dict]:
    if task == "gsm8k":
        return chat_messages(example.prompt)
    return [{"role": "user", "content": example.prompt}]


def format_prompt(example: Example, tokenizer, task: str, template: str = "plain") -> str:
    """The prompt text the model sees (before tokenisation)."""
    if template == "plain":
        return plain_prompt(example.prompt) if task == "gsm8k" else example.prompt
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.prompt_template=chat but the tokenizer has no chat_template; use prompt_template=plain"
            )
        return tokenizer.apply_chat_template(
            _messages(example, task), tokenize=False, add_generation_prompt=True
        )
    raise ValueError(f"data.prompt_template={template!r} is not one of 'plain', 'chat'")


def encode_prompts(tokenizer, examples: list[Example], task: str, template: str = "plain") -> list[list[int]]:
    """Unpadded prompt token ids for the rollout engine."""
    texts = [format_prompt(ex, tokenizer, task, template) for ex in examples]
    enc = tokenizer(texts, add_special_tokens=(template == "plain"))
    return [list(ids) for ids in enc["input_ids"]]


__all__ = [
    "Example",
    "PromptSampler",
    "encode_prompts",
    "format_prompt",
    "load_examples",
    "make_arithmetic_data",
    "prepare_gsm8k",
    "split_arithmetic",
]
