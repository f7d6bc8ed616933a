"""The arithmetic task: `{"prompt": "12+34=", "answer": "46"}` JSONL rows, scored by exact match."""

from __future__ import annotations

from typing import Any

from rl_core.data.jsonl import iter_jsonl, raise_row_errors, text_field
from rl_core.rewards import per_completion
from rl_core.rewards.arithmetic import arithmetic_reward
from rl_core.tasks.base import Example, Task


class ArithmeticTask(Task):
    name = "arithmetic"
    build_hint = "`posttrain make-data arithmetic --out data/arithmetic`"

    def load(self, source: str, data: Any) -> list[Example]:
        from pathlib import Path

        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"arithmetic split {str(source)!r} does not exist; build it with {self.build_hint}")
        out: list[Example] = []
        errors: list[str] = []  # every bad row, raised together
        for lineno, rec in iter_jsonl(path, "an arithmetic example {prompt, answer}", errors):
            try:
                if "prompt" not in rec or "answer" not in rec:
                    raise ValueError(f"{path}:{lineno}: needs 'prompt' and 'answer', got keys {sorted(rec)}")
                out.append(Example(text_field(rec, "prompt", path, lineno),
                                   text_field(rec, "answer", path, lineno, numbers=True), row=f"{path}:{lineno}"))
            except ValueError as exc:
                errors.append(str(exc))
        raise_row_errors(errors)
        return out

    def default_rewards(self, data: Any) -> list[tuple[str, Any]]:
        return [("arithmetic", per_completion(arithmetic_reward))]
