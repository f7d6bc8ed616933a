"""The task interface: `Example`, one prompt of a dataset, and `Task`, what a task implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt of a dataset.

    - `prompt`: the prompt text (for a chat-format row, the text of its last user message, for display).
    - `answer`: the reference answer when the dataset has one ("" otherwise); built-in rewards read it.
    - `messages`: a chat-format row's messages (`[{"role", "content"}, ...]`), None for a text prompt.
    - `columns`: what the rewards receive as keyword arguments, one list per column (e.g. `answer`).
    - `row`: where the row came from (`file:line` or `dataset row N`), for error messages.
    """

    prompt: str
    answer: str = ""
    messages: tuple[Mapping[str, str], ...] | None = None
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)
    row: str = field(default="", compare=False)

    def reward_columns(self) -> Mapping[str, Any]:
        return self.columns or {"answer": self.answer}


class Task:
    """The interface of a task (subclass it for your own; the built-in ones are in this package)."""

    name: str = "task"
    # data.* keys only this task reads (preflight refuses them under any other task)
    reads: tuple[str, ...] = ()
    # how to build a missing local split, for the error that says it is missing (None: nothing to build)
    build_hint: str | None = None
    # an agent task: the `rl_core.agents.Environment` subclass each row's episodes run in; None: one completion
    # per prompt
    environment: type | None = None

    def load(self, source: str, data: Any) -> list[Example]:
        """The examples of one split (`data.train` or `data.val`); ValueError naming the file and row."""
        raise NotImplementedError

    def instruction(self, data: Any) -> str | None:
        """Text appended to the user prompt: `data.instruction` when set, else the task's own (None: none)."""
        return data.instruction if data is not None and data.instruction is not None else None

    def plain_text(self, example: Example, data: Any) -> str:
        """The prompt of `prompt_template=plain` (base models), before tokenisation."""
        parts = [data.system_prompt] if data is not None and data.system_prompt else []
        parts.append(example.prompt)
        if (extra := self.instruction(data)) is not None:
            parts.append(extra)
        return "\n".join(parts)

    def messages(self, example: Example, data: Any) -> list[dict]:
        """The chat messages of `prompt_template=chat`, rendered with the tokenizer's chat template."""
        system = data.system_prompt if data is not None else None
        if example.messages is not None:
            messages = [dict(m) for m in example.messages]
        else:
            messages = [{"role": "user", "content": example.prompt}]
        if (extra := self.instruction(data)) is not None:
            last = messages[-1]
            messages[-1] = {**last, "content": f"{last['content'].strip()}\n{extra}"}
        if system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def default_rewards(self, data: Any) -> list[tuple[str, Any]]:
        """`(name, fn)` of the rewards used when `data.rewards` is unset; each fn is TRL-style
        `fn(prompts, completions, **columns) -> list[float | None]` (rl_core.rewards)."""
        if self.environment is not None:
            return []  # the environment's own reward is enough (`fixed_rewards`)
        raise ValueError(f"data.task={self.name!r} has no reward of its own; list yours in data.rewards")

    def fixed_rewards(self, data: Any) -> list[tuple[str, Any]]:
        """`(name, fn)` of the rewards that apply whatever `data.rewards` says: an environment's own reward."""
        return [] if self.environment is None else [("environment", environment_reward)]

    def supervised_target(self, example: Example) -> str:
        """The text a supervised warm start teaches after the prompt."""
        return example.answer

    def scorable(self, example: Example) -> bool:
        """Whether held-out scoring can judge this example (e.g. GSM8K needs a number in the answer)."""
        return True


ENVIRONMENT_REWARD = "environment_reward"  # the column that hands each episode's own reward to the reward functions


def environment_reward(prompts: list, completions: list, environment_reward: list[float], **_: Any) -> list[float]:
    """Each episode's reward as its environment gave it (`Environment.reward()`); a reward function like any other,
    so it is weighed and logged with `data.rewards`."""
    return [float(r) for r in environment_reward]


def is_import_path(name: str) -> bool:
    return ":" in name
