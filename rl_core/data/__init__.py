"""Loading examples through their task, prompt templates and the seeded prompt sampler.

An `Example` (rl_core.tasks) is a prompt with its answer and reward columns: for arithmetic the prompt
is `"12+34="` and the answer `"46"`; for GSM8K the question and the official answer field (ending
`#### N`). `encode_prompts` turns examples into the token ids the rollout engine takes, with the
configured template:

- plain: the task's plain text (arithmetic prompts as they are; GSM8K as `Question: ...\\nAnswer:`),
  tokenised with the tokenizer's own special tokens (e.g. the tiny model's `<bos>`).
- chat: the task's messages (GSM8K adds an instruction to end with `#### <number>`) rendered with the
  tokenizer's chat template and a generation prompt; the template supplies its own special tokens.
"""

from __future__ import annotations

from pathlib import Path

from rl_core.data.arithmetic import make_arithmetic_data, split_arithmetic
from rl_core.data.gsm8k import prepare_gsm8k
from rl_core.data.sampler import PromptSampler
from rl_core.tasks import Example, Task, get_task


def _task(task: str | Task) -> Task:
    return task if isinstance(task, Task) else get_task(task)


def load_examples(source: str | Path, task: str | Task, data=None) -> list[Example]:
    """The examples of one split, loaded by the task (`data` is the `data` config section, or None for the
    task's defaults). Bad rows raise ValueError naming the file and row."""
    return _task(task).load(str(source), data)


def format_prompt(example: Example, tokenizer, task: str | Task, template: str = "plain", data=None) -> str:
    """The prompt text the model sees (before tokenisation)."""
    task = _task(task)
    if template == "plain":
        return task.plain_text(example, data)
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "data.prompt_template=chat but the tokenizer has no chat_template; use prompt_template=plain"
            )
        return tokenizer.apply_chat_template(task.messages(example, data), tokenize=False, add_generation_prompt=True)
    raise ValueError(f"data.prompt_template={template!r} is not one of 'plain', 'chat'")


def encode_prompts(tokenizer, examples: list[Example], task: str | Task, template: str = "plain",
                   data=None) -> list[list[int]]:
    """Unpadded prompt token ids for the rollout engine."""
    task = _task(task)
    texts = [format_prompt(ex, tokenizer, task, template, data) for ex in examples]
    enc = tokenizer(texts, add_special_tokens=(template == "plain"))
    return [list(ids) for ids in enc["input_ids"]]


def encode_for(data, tokenizer, examples: list[Example]) -> list[list[int]]:
    """`encode_prompts` with the task, template, system prompt and instruction of the `data` config section."""
    return encode_prompts(tokenizer, examples, data.task, data.prompt_template, data)


__all__ = [
    "Example",
    "PromptSampler",
    "encode_for",
    "encode_prompts",
    "format_prompt",
    "load_examples",
    "make_arithmetic_data",
    "prepare_gsm8k",
    "split_arithmetic",
]
