"""A GPU work pool for posttrain's deployments: a process pool whose runs see the GPUs a deployment names.

The pool `posttrain services up` creates (`infra.services.prefect_api.process_pool_template`) has no job variables that
reach the flow-run process: no `command`, `env` or `working_dir`, and unknown ones refused. A GPU machine's
pool needs one thing more, which GPUs a deployment's runs see. This template adds exactly that, as a typed
variable, `cuda_visible_devices` (GPU indices, `0,1,2,3`), written to the run's `CUDA_VISIBLE_DEVICES`; still
no `env`, so neither a deployment nor a flow run can set any other variable of the run's environment.

A deployment sets it in prefect.yaml (`work_pool.job_variables`, the operator's); a flow run created on the API
may not set job variables at all (flows/guard.py refuses the run), so a caller cannot move a run to other GPUs.

    python -m infra.services.work_pools gpu > gpu-pool.json       # `process`: the pool `posttrain services up` creates
    prefect work-pool create posttrain-gpu --type process --base-job-template gpu-pool.json
    prefect worker start --pool posttrain-gpu        # on the GPU machine, in this checkout's venv
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from infra.services.prefect_api import FIXED_JOB_FIELDS, process_pool_template

GPU_POOL = "posttrain-gpu"
GPU_VARIABLE = "cuda_visible_devices"


def gpu_pool_template() -> dict:
    """The base job template of the GPU pool: the process pool's, plus `cuda_visible_devices` -> CUDA_VISIBLE_DEVICES."""
    template = process_pool_template()
    template["job_configuration"]["env"] = {"CUDA_VISIBLE_DEVICES": "{{ " + GPU_VARIABLE + " }}"}
    template["variables"]["properties"][GPU_VARIABLE] = {
        "title": "CUDA_VISIBLE_DEVICES", "type": "string", "pattern": r"^[0-9]+(,[0-9]+)*$",
        "description": "The GPUs (indices, comma-separated) the deployment's runs see; unset: every GPU of the machine.",
    }
    return template


def template_problems(template: dict[str, Any]) -> list[str]:
    """What a pool's base job template lets a flow run or deployment choose that it must not: a job variable
    `command`, `env` or `working_dir` (Prefect's default process template has all three, so a pool made with a plain
    `prefect work-pool create` runs whatever command a caller names), or variables the template does not declare.
    Empty for posttrain's templates (`process_pool_template`, `gpu_pool_template`)."""
    variables = template.get("variables") or {}
    open_fields = [f for f in FIXED_JOB_FIELDS if f in (variables.get("properties") or {})]
    problems = [f"its job variable {f!r} lets a flow run or deployment set the run's {f.replace('_', ' ')}"
                for f in open_fields]
    if variables.get("additionalProperties", True) is not False:
        problems.append("it accepts job variables it does not declare (variables.additionalProperties is not false)")
    return problems


def pool_warnings(api_url: str, auth_string: str | None, pools: list[str]) -> list[str]:
    """One line per pool of `pools` (on the Prefect API at `api_url`) whose template has `template_problems`, or
    that does not exist (`prefect deploy` then leaves it to whoever creates it, with Prefect's default template)."""
    from prefect.client.orchestration import PrefectClient
    from prefect.exceptions import ObjectNotFound

    async def read() -> dict[str, dict | None]:
        out: dict[str, dict | None] = {}
        async with PrefectClient(api=api_url, auth_string=auth_string) as client:
            for name in pools:
                try:
                    out[name] = (await client.read_work_pool(name)).base_job_template
                except ObjectNotFound:
                    out[name] = None
        return out

    fix = ("recreate it with posttrain's template: `python -m infra.services.work_pools process > pool.json` (or `gpu` for a "
           "GPU pool), then `prefect work-pool create {name} --overwrite --type process --base-job-template pool.json`")
    warnings = []
    for name, template in asyncio.run(read()).items():
        if template is None:
            warnings.append(f"work pool {name!r} does not exist; create it with posttrain's template, not "
                            f"Prefect's default (which lets a flow run choose its command): {fix.format(name=name)}")
            continue
        warnings += [f"work pool {name!r}: {problem}; {fix.format(name=name)}" for problem in template_problems(template)]
    return warnings


def main(argv: list[str]) -> None:
    """`python -m infra.services.work_pools [gpu|process]`: print the GPU pool's template, or the process pool's."""
    which = argv[0] if argv else "gpu"
    if which not in ("gpu", "process"):
        sys.exit("usage: python -m infra.services.work_pools [gpu|process]  (the GPU pool's template, or the process pool's)")
    print(json.dumps(gpu_pool_template() if which == "gpu" else process_pool_template(), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
