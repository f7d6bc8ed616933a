"""Local services and deployments.

- `supervisor`: `posttrain services up|down|status` (a Prefect server, the `posttrain-process` work pool and a
  worker, an MLflow server on 127.0.0.1) and the Prefect API settings runs start with.
- `work_pools`: the GPU work pool's template (`python -m infra.services.work_pools gpu`).
- `deploy_steps`: the Prefect pull step of posttrain's deployments (`infra.services.deploy_steps.enter_project`)."""
