"""On-policy distillation (OPD): GRPO's topology plus a frozen teacher role (docs/objectives.md).

Each step runs `rollout -> reward -> annotate -> teacher -> distill -> validate -> train -> sync`,
then `evaluate` and `checkpoint` on cadence. The student (the policy workers, synced to the rollout
engine) samples; the teacher (`cluster.teacher_replicas` `infra.workers.teacher.TeacherWorker` actors beside the
trainer ranks, never synced) scores the sampled tokens at the loss temperature, each replica a contiguous
share of the rows in parallel; the scores travel as `batch.teacher_logp`, checked by the
gate; `distill` turns them into per-token advantages (`rl.objective.distillation_mode=advantage`) or leaves
the batch for the direct reverse-KL loss. The annotations table keeps the task reward's group
advantage (logged, and a training signal only with `rl.objective.task_reward_weight > 0`).

    posttrain run recipes/opd_arithmetic.py -- rl.max_steps=50
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.on_policy import run_on_policy
from flows.params import NO_KNOBS, RunKnobs, open_run
from flows.restarts import run_with_restarts
from rl_core.config import PosttrainConfig
from rl_core.config.explain import ConfigError


def require_teacher(cfg: PosttrainConfig) -> None:
    """OPD needs `model.teacher`; refuse before any placement or model construction."""
    if cfg.rl.objective.topology != "teacher":
        raise ConfigError([(f"rl.objective.type={cfg.rl.objective.type}: the opd flow trains objectives with a teacher "
                           "only (rl.objective.type=opd)")])
    if not cfg.model.teacher:
        raise ConfigError([("model.teacher is not set: OPD distils a frozen teacher into the policy; set "
                            "model.teacher to a hub id or a model directory that shares the policy's tokenizer "
                            "(e.g. model.teacher=artifacts/tiny-model/teacher)")])


@flow(name="opd", log_prints=True)
def opd(recipe: str, overrides: list[str] | None = None, knobs: RunKnobs = NO_KNOBS) -> dict:
    """Train an OPD recipe (on-policy distillation from a frozen teacher).

    Args:
        recipe: A recipe file under recipes/ (Python: its build_config() returns the config), or a finished run's
            config_resolved.yaml.
        overrides: Changes to the recipe, `key=value` each (e.g. rl.max_steps=20); from the API, the keys of
            flows/guard.py's allowlist only.
        knobs: The recipe knobs changed most often, typed; each one set is one more override.
    """
    overrides, cfg = open_run(recipe, overrides, knobs)  # guarded, checked (preflight), the run named job.name
    require_teacher(cfg)
    return run_with_restarts(cfg, lambda c: run_on_policy(c, recipe, overrides, with_teacher=True),
                             get_run_logger().warning)
