"""Restarts of a run whose Ray actor or node died: which errors are a lost actor, and the run started again from its
newest checkpoint (`job.max_restarts`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_core.config import PosttrainConfig


def lost_actor(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is a Ray actor or node that died: what a restart survives.

    What it was raised from is the chain Python prints: the cause, else the context unless `raise ... from None`
    suppressed it. An error of user code (a reward, whose worker may have died under it; a task, environment or
    custom objective) is never a lost actor: re-placing the trainers would not fix it, the task's retries are its
    remedy."""
    import ray.exceptions as rex

    from rl_core.rewards import RewardError
    from rl_core.user_code import UserCodeError

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (RewardError, UserCodeError)):
            return False
        if isinstance(exc, (rex.RayActorError, rex.NodeDiedError, rex.OwnerDiedError)):
            return True
        chained = exc.__cause__ if exc.__cause__ is not None else \
            (None if exc.__suppress_context__ else exc.__context__)
        exc, seen = chained, seen + 1
    return False


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition for the phase tasks (`retry_condition_fn`): every failure but one its error marks
    `retryable=False`, a bug in user code that the same call raises again (an environment's reward() raising a
    TypeError): that step fails at once, its error said once, instead of after job.task_retries identical tries."""
    return getattr(state.data, "retryable", True) is not False


def run_with_restarts(cfg: PosttrainConfig, body: Callable[[PosttrainConfig], dict],
                      announce: Callable[..., None]) -> dict:
    """`body(cfg)`, started again (at most `job.max_restarts` times) when a Ray actor or node dies under it.

    A restart places every role anew and resumes from the newest checkpoint (`rl.resume=auto`, also when
    the run was started with `off`: its own directory is now the run to continue), so it loses at most the
    `rl.save_every` steps since that checkpoint; those steps are redone exactly. After the last restart the
    flow fails with the actor error, saying how many restarts were made.
    """
    attempt_cfg = cfg
    for restart in range(cfg.job.max_restarts + 1):
        try:
            result = body(attempt_cfg)
            return {**result, "restarts": restart}
        except Exception as exc:
            if not lost_actor(exc):
                raise
            if restart == cfg.job.max_restarts:
                raise RuntimeError(f"a Ray actor died again after {restart} automatic restart(s) "
                                   f"(job.max_restarts={cfg.job.max_restarts}): {type(exc).__name__}: {exc}; "
                                   "the run can be continued with rl.resume=auto once the cluster is healthy") from exc
            announce("a Ray actor died (%s: %s); restart %d of %d from the newest checkpoint",
                     type(exc).__name__, str(exc).splitlines()[0][:200], restart + 1, cfg.job.max_restarts)
            attempt_cfg = cfg.model_copy(deep=True)
            attempt_cfg.rl.resume = "auto"
    raise AssertionError("unreachable")
