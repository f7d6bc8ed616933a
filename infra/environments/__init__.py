"""The environment role: an agent task's environments in Ray actors, with timeouts (`pool`)."""

from infra.environments.pool import EnvironmentPool, EnvironmentWorker

__all__ = ["EnvironmentPool", "EnvironmentWorker"]
