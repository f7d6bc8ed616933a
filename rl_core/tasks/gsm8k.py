"""The GSM8K task: official `{question, answer}` JSONL (or the hub dataset), the answer's `#### N` scored exactly.

`data.train` / `data.val` is a JSONL file, a directory holding `train.jsonl` / `test.jsonl`, or a hub dataset id
with an optional split (`openai/gsm8k:test`; default `train`) in `data.dataset_config` (default `main`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from rl_core.data.gsm8k import GSM8K_INSTRUCTION, load_gsm8k_split, plain_prompt
from rl_core.rewards import per_completion
from rl_core.rewards.gsm8k import extract_reference, gsm8k_reward
from rl_core.tasks.base import Example, Task


class GSM8KTask(Task):
    name = "gsm8k"
    reads = ("reward_mode",)
    build_hint = "`dvc repro pipelines/gsm8k/dvc.yaml` or `posttrain make-data gsm8k`"

    def load(self, source: str, data: Any) -> list[Example]:
        config = getattr(data, "dataset_config", None) or "main"
        if Path(source).exists():
            records = load_gsm8k_split(source, "train", config)  # a file path: the split is the file
        else:
            name, _, split = str(source).partition(":")
            records = load_gsm8k_split(name, split or "train", config)
        return [Example(r["question"], r["answer"], row=r.get("row", "")) for r in records]

    def instruction(self, data: Any) -> str | None:
        return data.instruction if data is not None and data.instruction is not None else GSM8K_INSTRUCTION

    def plain_text(self, example: Example, data: Any) -> str:
        text = plain_prompt(example.prompt)
        if data is not None and data.instruction is not None:  # base models: only an instruction you set
            text = text.replace("\nAnswer:", f"\n{data.instruction}\nAnswer:")
        if data is not None and data.system_prompt:
            text = f"{data.system_prompt}\n{text}"
        return text

    def default_rewards(self, data: Any) -> list[tuple[str, Any]]:
        mode = data.reward_mode if data is not None else "strict"
        return [(f"gsm8k_{mode}", per_completion(functools.partial(gsm8k_reward, mode=mode)))]

    def supervised_target(self, example: Example) -> str:
        return " " + example.answer

    def scorable(self, example: Example) -> bool:
        return extract_reference(example.answer) is not None
