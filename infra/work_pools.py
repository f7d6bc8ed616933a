"""A GPU work pool for posttrain's deployments: a process pool whose runs see the GPUs a deployment names.

The pool `posttrain services up` creates (`infra.services.process_pool_template`) has no job variables that
reach the flow-run process: no `command`, `env` or `working_dir`, and unknown ones refused. A GPU machine's
pool needs one thing more, which GPUs a deployment's runs see. This template adds exactly that, as a typed
variable, `cuda_visible_devices` (GPU indices, `0,1,2,3`), written to the run's `CUDA_VISIBLE_DEVICES`; still
no `env`, so neither a deployment nor a flow run can set any other variable of the run's environment.

A deployment sets it in prefect.yaml (`work_pool.job_variables`, the operator's); a flow run created on the API
may not set job variables at all (flows/guard.py refuses the run), so a caller cannot move a run to other GPUs.

    python -m infra.work_pools > gpu-pool.json
    prefect work-pool create posttrain-gpu --type process --base-job-template gpu-pool.json
    prefect worker start --pool posttrain-gpu        # on the GPU machine, in this checkout's venv
"""

from __future__ import annotations

import json

from infra.services import process_pool_template

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


if __name__ == "__main__":
    print(json.dumps(gpu_pool_template(), indent=2))
