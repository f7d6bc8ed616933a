"""What a flow run started from a deployment may be given as parameters.

Anyone who may create flow runs on the Prefect API chooses a deployment's parameters, so those
parameters are untrusted input, unlike the command line of `posttrain run`:

- `recipe` must be a file under the project's `recipes/` directory: a recipe is Python and runs in
  the flow (any other path would run an arbitrary file).
- overrides may not set `model.trust_remote_code` (model code from the hub), `job.out_dir` or
  `job.overwrite` (what is written and deleted where), unless the deployment opts in with the tag
  `posttrain:allow-unsafe-overrides` in prefect.yaml (read from the deployment on the API: a flow
  run's own tags are the caller's to choose), or the operator does for every deployment with
  `POSTTRAIN_ALLOW_UNSAFE_OVERRIDES=1` in the worker's environment.

Runs not started from a deployment (`posttrain run`, a flow called in Python) are not restricted.
"""

from __future__ import annotations

from pathlib import Path

from rl_core.config.loader import ConfigError

UNSAFE_OVERRIDES = ("model.trust_remote_code", "job.out_dir", "job.overwrite")
OPT_IN_TAG = "posttrain:allow-unsafe-overrides"
OPT_IN_ENV = "POSTTRAIN_ALLOW_UNSAFE_OVERRIDES"


def deployment_problems(recipe: str, overrides: list[str], *, project: Path, allow_unsafe: bool) -> list[str]:
    """Why these deployment parameters are refused (empty: accepted). Pure: the caller says where the project is."""
    problems = []
    recipes = (project / "recipes").resolve()
    path = (project / recipe).resolve() if not Path(recipe).is_absolute() else Path(recipe).resolve()
    if not (path.is_relative_to(recipes) and path.suffix == ".py" and path.is_file()):
        problems.append(f"recipe={recipe!r}: a deployment runs recipes under {recipes}/ only (a recipe is code); "
                        "add the recipe to the project and deploy it")
    if not allow_unsafe:
        for item in overrides:
            key = str(item).partition("=")[0].strip()
            if key in UNSAFE_OVERRIDES:
                problems.append(f"override {key}: not accepted from a deployment's run parameters; set it in the "
                                f"recipe, or tag the deployment {OPT_IN_TAG!r} in prefect.yaml to allow it")
    return problems


def check_run_parameters(recipe: str, overrides: list[str]) -> None:
    """Refuse untrusted parameters of a flow run that a deployment started (before the recipe is loaded)."""
    import os

    from prefect.runtime import deployment

    if not deployment.id:
        return
    allow = os.environ.get(OPT_IN_ENV, "").strip().lower() in ("1", "true", "yes") or OPT_IN_TAG in _deployment_tags(
        deployment.id)
    problems = deployment_problems(recipe, list(overrides), project=Path.cwd(), allow_unsafe=allow)
    if problems:
        raise ConfigError(problems, f"parameters of deployment {deployment.name!r}")


def _deployment_tags(deployment_id: str) -> set[str]:
    """The deployment's own tags, from the API (not the flow run's, which whoever starts it may add to)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return set(client.read_deployment(deployment_id).tags or ())
