"""The built-in tasks by name (`data.task=<name>`)."""

from __future__ import annotations

from rl_core.tasks.arithmetic import ArithmeticTask
from rl_core.tasks.base import Task
from rl_core.tasks.gsm8k import GSM8KTask
from rl_core.tasks.prompts import PromptsTask
from rl_core.tasks.reasoning_gym import ReasoningGymTask

TASKS: dict[str, Task] = {t.name: t for t in (ArithmeticTask(), GSM8KTask(), PromptsTask(), ReasoningGymTask())}
