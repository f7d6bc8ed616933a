"""What a flow run created on the Prefect API may be given as parameters.

Anyone who may create flow runs on the API chooses their parameters, so the parameters of the flow
run a worker starts for it are untrusted input, unlike the command line of `posttrain run` or the
subflows that a checked flow starts itself:

- `recipe` must be a file under the project's `recipes/` directory (a recipe is Python and runs in
  the flow).
- `overrides` is an allowlist, `API_OVERRIDES`: recipe knobs (steps, learning rate, seeds, batch
  sizes, sampling, objective coefficients, evaluation cadence, resources). Everything else comes
  from the recipe or the operator only: import paths (`rl.objective.import_path`/`kwargs`, `data.rewards`, `data.task`),
  models (`model.*`, `rl.reference`), data paths, the Ray address, tracking and checkpoint URIs
  (the worker's credentials go to them), output paths and names, pruning. The typed `knobs`
  (flows/params.py) are overrides by the time they are judged, the same way. The one allowed key
  that names a place, `tracking.experiment`, cannot move the run's artifacts: the tracker refuses an
  experiment whose artifact location is not the store's own (`infra.tracking.experiments.check_artifact_location`).
- The regression flow's own parameters: thresholds and reference under `regression/`, its output
  directory and MLflow store from the operator only, its overrides under the same allowlist.

The operator may lift the allowlist (never the recipe rule) for one deployment with the tag
`posttrain:allow-unsafe-overrides` in prefect.yaml (read from the deployment as stored on the API: a
flow run's own tags are the caller's to choose), or for every deployment with
`POSTTRAIN_ALLOW_UNSAFE_OVERRIDES=1` in the worker's own environment. A flow run's job variables
cannot set that variable or change the command that runs: the work pool's base job template
(`infra.services.prefect_api.process_pool_template`) has no `command`, `env` or `working_dir` variable and refuses
unknown ones, and the guard refuses a run that carries job variables all the same (a pool created
with Prefect's default template).

Which run is judged: the one a worker started (its id is the worker's `PREFECT__FLOW_RUN_ID`), or
any run of a deployment, except a subflow that a checked flow starts in the same process
(`trusted_subflows`). Runs not started from the API (`posttrain run`, a flow called in Python) are
not restricted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from rl_core.config.explain import ConfigError, objective_keys
from rl_core.redact import redact_text

OPT_IN_TAG = "posttrain:allow-unsafe-overrides"
OPT_IN_ENV = "POSTTRAIN_ALLOW_UNSAFE_OVERRIDES"
FLOW_RUN_ID_ENV = "PREFECT__FLOW_RUN_ID"  # set by the worker for the flow run it starts

# The overrides a caller of the API may give (exact dotted keys). Not listed, so from the recipe or the operator
# only: model.*, data.task/train/val/dataset_config/rewards/reward_workers/env_workers, rl.reference, rl.objective.import_path/kwargs, cluster.address, tracking.*
# except the experiment name, job.name/out_dir/overwrite.
API_OVERRIDES = frozenset({
    "job.seed", "job.task_retries", "job.retry_delay_s", "job.max_restarts",
    "model.compute_dtype", "model.gradient_checkpointing",
    "rollout.backend", "rollout.num_engines", "rollout.temperature", "rollout.top_p", "rollout.max_tokens",
    "rollout.max_turns", "rollout.max_episode_tokens", "rollout.episode_scheduling", "rollout.n", "rollout.prompts_per_step", "rollout.seed", "rollout.gpu_memory_utilization",
    "rl.mini_batch_per_replica", "rl.micro_batch_per_replica", "rl.async_steps", "rl.max_steps", "rl.save_every", "rl.resume",
    "rl.optimizer.lr", "rl.optimizer.betas", "rl.optimizer.weight_decay", "rl.optimizer.warmup_steps",
    "rl.optimizer.max_grad_norm", "rl.validation.every_steps", "rl.validation.before_training",
    "rl.validation.max_prompts",
    "data.prompt_template", "data.reward_mode", "data.system_prompt", "data.instruction", "data.reward_timeout_s", "data.env_timeout_s",
    "cluster.num_workers", "cluster.cpus_per_worker", "cluster.gpus_per_worker", "cluster.placement",
    "cluster.cpus_per_engine", "cluster.gpus_per_engine", "cluster.placement_strategy", "cluster.placement_timeout_s",
    "cluster.sharding", "cluster.shard_size", "cluster.gpu_memory_gib",
    "tracking.experiment",
}) | {f"rl.objective.{key}" for key in objective_keys() if key not in ("import_path", "kwargs")}

# The regression flow's parameters that only the operator sets (their defaults are the deployment's).
REGRESSION_OPERATOR_PARAMETERS = {"out_dir": "runs/regression", "mlflow_uri": None}

_trusted_caller: ContextVar[bool] = ContextVar("posttrain_trusted_caller", default=False)


@contextlib.contextmanager
def trusted_subflows() -> Iterator[None]:
    """Inside: flows started by this (checked) flow take their parameters from its code, not from the caller."""
    token = _trusted_caller.set(True)
    try:
        yield
    finally:
        _trusted_caller.reset(token)


def override_problems(overrides: list, *, allow_unsafe: bool) -> list[str]:
    """Why these overrides are refused from the API (empty: accepted)."""
    problems = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            problems.append(f"override {redact_text(repr(item))[:80]}: not a key=value string")
            continue
        key = item.partition("=")[0].strip()
        if not allow_unsafe and key not in API_OVERRIDES:
            problems.append(f"override {redact_text(key)[:80]}: not accepted from a flow run's parameters (models, "
                            "data, import paths, endpoints and output paths come from the recipe or the operator); "
                            f"set it in the recipe, or tag the deployment {OPT_IN_TAG!r} in prefect.yaml")
    return problems


def deployment_problems(recipe: str, overrides: list, *, project: Path, allow_unsafe: bool) -> list[str]:
    """Why these parameters of a flow run from the API are refused (empty: accepted). Pure: the caller says where
    the project is."""
    problems = []
    recipes = (project / "recipes").resolve()
    path = (project / recipe).resolve() if not Path(recipe).is_absolute() else Path(recipe).resolve()
    if not (path.is_relative_to(recipes) and path.suffix == ".py" and path.is_file()):
        problems.append(f"recipe={redact_text(str(recipe))!r}: a deployment runs recipes under {recipes}/ only (a "
                        "recipe is code); add the recipe to the project and deploy it")
    if not isinstance(overrides, list):
        return [*problems, "overrides: not a list of key=value strings"]
    return problems + override_problems(overrides, allow_unsafe=allow_unsafe)


def regression_problems(params: dict, *, project: Path, allow_unsafe: bool) -> list[str]:
    """Why these parameters of the regression flow from the API are refused (empty: accepted)."""
    problems = []
    base = (project / "regression").resolve()
    for name in ("thresholds", "reference"):
        value = str(params[name])
        path = Path(value) if Path(value).is_absolute() else project / value
        if not (path.resolve().is_relative_to(base) and path.resolve().is_file()):
            problems.append(f"{name}={redact_text(value)!r}: a deployment reads {name} under {base}/ only")
    if not allow_unsafe:
        for name, default in REGRESSION_OPERATOR_PARAMETERS.items():
            if params.get(name) != default:
                problems.append(f"{name}: not accepted from a flow run's parameters (the operator's); set it in the "
                                f"deployment, or tag the deployment {OPT_IN_TAG!r} in prefect.yaml")
    overrides = params.get("overrides") or []
    if not isinstance(overrides, list):
        return [*problems, "overrides: not a list of key=value strings"]
    return problems + override_problems(overrides, allow_unsafe=allow_unsafe)


def started_from_api() -> bool:
    """True in a flow run whose parameters a caller of the API chose: the run a worker started, or any run of a
    deployment outside `trusted_subflows`."""
    from prefect.runtime import deployment, flow_run

    if _trusted_caller.get():
        return False
    launched = os.environ.get(FLOW_RUN_ID_ENV)
    return bool(deployment.id) or (bool(launched) and str(flow_run.id) == launched)


def check_run_parameters(recipe: str, overrides: list) -> None:
    """Refuse untrusted parameters of a training flow run started from the API (before the recipe is loaded)."""
    if started_from_api():
        _refuse(lambda allow: deployment_problems(recipe, overrides, project=Path.cwd(), allow_unsafe=allow))


def check_regression_parameters(**params) -> None:
    """Refuse untrusted parameters of a regression flow run started from the API."""
    if started_from_api():
        _refuse(lambda allow: regression_problems(params, project=Path.cwd(), allow_unsafe=allow))


def _refuse(problems_for) -> None:
    from prefect.runtime import deployment, flow_run

    run = _read_flow_run(str(flow_run.id))
    deployment_id = run.deployment_id or deployment.id
    allow = os.environ.get(OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes") or (
        deployment_id is not None and OPT_IN_TAG in _deployment_tags(str(deployment_id)))
    problems = problems_for(allow)
    if run.job_variables:
        problems.append(f"job variables {sorted(run.job_variables)}: a flow run may not set job variables (the "
                        "command and environment are the work pool's); give none")
    if problems:
        raise ConfigError(problems, f"parameters of deployment {deployment.name!r}")


def _read_flow_run(flow_run_id: str):
    """This flow run as stored on the API (its job variables and deployment)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def _deployment_tags(deployment_id: str) -> set[str]:
    """The deployment's own tags, from the API (not the flow run's, which whoever starts it may add to)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return set(client.read_deployment(deployment_id).tags or ())
