"""The built-in tasks by name (`data.task=<name>`)."""

from __future__ import annotations

from rl_core.tasks.arithmetic import ArithmeticTask
from rl_core.tasks.base import Task
from rl_core.tasks.gsm8k import GSM8KTask
from rl_core.tasks.prompts import PromptsTask

TASKS: dict[str, Task] = {t.name: t for t in (ArithmeticTask(), GSM8KTask(), PromptsTask())}
