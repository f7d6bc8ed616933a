"""Shim, kept for one release: deployments registered with the pull step `infra.deploy_steps.enter_project` go on
working. The step lives in `infra.services.deploy_steps`; `prefect deploy --all` registers that path."""

from infra.services.deploy_steps import enter_project

__all__ = ["enter_project"]
