"""An environment as a task: `data.task=package.module:MyEnvironment` names an `Environment` subclass, and each
row of `data.train` / `data.val` becomes one episode of it (`rollout.n` episodes per row per step).

The rows are read as by the `prompts` task (JSONL, Parquet or a `datasets` dataset; a `prompt` or `messages`
column, any other columns kept on the `Example` for the environment and the reward functions). The environment's
`reward()` is always part of the reward, as the function named `environment` (weight 1, metric
`rollout/rewards/environment/mean`); the functions of `data.rewards` are added to it.
"""

from __future__ import annotations

from typing import Any

from rl_core.tasks.base import ENVIRONMENT_REWARD
from rl_core.tasks.prompts import PromptsTask


class EnvironmentTask(PromptsTask):
    """The `prompts` task's rows, each an episode of `environment`."""

    def __init__(self, environment: type, name: str):
        self.environment = environment
        self.name = name

    def load(self, source: str, data: Any) -> list:
        examples = super().load(source, data)
        if examples and ENVIRONMENT_REWARD in examples[0].columns:
            raise ValueError(f"{examples[0].row}: column {ENVIRONMENT_REWARD!r} is reserved (the environment's reward, "
                             "handed to the reward functions); rename it")
        return examples


def configure_environment(environment: type, rollout: Any) -> None:
    """Tell an environment class the recipe's sampling, when it asks (`configure`: an agent function's gateway checks
    a request's temperature and top_p against it)."""
    configure = getattr(environment, "configure", None)
    if callable(configure):
        configure(rollout.temperature, rollout.top_p)
