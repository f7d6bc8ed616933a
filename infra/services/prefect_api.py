"""Talking to a Prefect API server posttrain starts: the server settings it starts with, basic auth, its health,
CSRF tokens for writes, and the process work pool's template without the job variables a flow run could use to
change what runs."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

# Prefect API server settings for the servers posttrain starts (`infra.services.supervisor`'s `prefect server`, and the temporary one
# of `posttrain run`); a user's own values win. Prefect's task-run recorder writes each task run's state events one
# transaction at a time (batch size 1); in batches of up to 100, written at least once a second, the server spends
# about 40% less CPU per task run (benchmarks/bench_prefect_task.py), CPU the trainer and engines share on a small
# machine. The UI shows a task run's state up to a second later; a server that stops writes one last batch. (Prefect
# truncates the interval to whole seconds: below 1 its flush loop would never sleep.)
PREFECT_SERVER_DEFAULTS = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
                           "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1"}


def use_prefect_server_defaults() -> None:
    """Put `PREFECT_SERVER_DEFAULTS` in this process's environment where unset: a temporary API server it
    starts inherits them."""
    for key, value in PREFECT_SERVER_DEFAULTS.items():
        os.environ.setdefault(key, value)


AUTH_ENV = "PREFECT_API_AUTH_STRING"  # the client side of Prefect's basic auth (`user:password`)


def auth_header(auth: str | None) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}


def http_ok(url: str, auth: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_header(auth)), timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def csrf_headers(api: str, auth: str | None) -> dict[str, str]:
    """A CSRF token for one write, as the Prefect client gets it (`GET /csrf-token?client=...`)."""
    import uuid

    client = str(uuid.uuid4())
    request = urllib.request.Request(f"{api}/csrf-token?client={client}", headers=auth_header(auth))
    with urllib.request.urlopen(request, timeout=5) as resp:
        token = json.loads(resp.read())["token"]
    return {"Prefect-Csrf-Token": token, "Prefect-Csrf-Client": client}


# Job variables a flow run's creator could use to run another command, set the worker's environment (an opt-in,
# credentials) or move the flow's directory: not variables of the pool's template, so fixed by the worker.
FIXED_JOB_FIELDS = ("command", "env", "working_dir")


def process_pool_template() -> dict:
    """Prefect's process work-pool base job template without `FIXED_JOB_FIELDS`, refusing unknown variables.

    A job variable reaches the flow-run process only through a `{{ placeholder }}` of `job_configuration`, and the
    worker merges an `env` variable into a dict-valued `env` of it: with neither, the worker runs its own command
    (`python -m prefect.engine`) in its own environment, whatever a flow run or deployment sets; the server refuses
    a flow run with other variables (`additionalProperties: false`)."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    for key in FIXED_JOB_FIELDS:
        template["job_configuration"].pop(key, None)
        template["variables"]["properties"].pop(key, None)
    template["variables"]["additionalProperties"] = False
    return template
