"""Run a recipe's flow: the step loop of its objective (`rl.objective`): on-policy, with a teacher, or offline."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from flows import startup
from infra.processes import child_listening_on
from infra.services.prefect_api import use_prefect_server_defaults
from rl_core.preflight.rules import load_checked
from rl_core.redact import redact_text

log = logging.getLogger("posttrain.startup")

# Quiet, local defaults for the embedded Prefect API (a user's own settings win).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The run's progress display is its own: MLflow's artifact bars (each append to the completions table downloads the
# table first) would draw into it.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# Prefect gives its temporary (ephemeral) API server 20 s to start; on a loaded 2-core machine that failed
# 2 runs in 4 ("Timed out while attempting to connect to ephemeral Prefect API server"). Startup is ~17 s
# on a quiet one, so allow 3 minutes (a user's own value wins).
EPHEMERAL_STARTUP_TIMEOUT_S = "180"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S)
use_prefect_server_defaults()  # the temporary API server's task-run recorder batches its writes


def flow_for(objective):
    """The Prefect flow that runs this objective's step loop (`objective.topology`), imported only when chosen."""
    topology = objective.topology
    if topology == "teacher":
        from flows.opd import opd as flow
    elif topology == "offline":
        from flows.dpo import dpo as flow
    else:
        from flows.grpo import grpo as flow
    return flow


def run_recipe(recipe: str, overrides: list[str]) -> dict:
    startup.mark("imports")
    # config and preflight errors surface here, before Prefect starts; the flow takes this config, not a second load
    cfg = load_checked(str(recipe), list(overrides), hand_over=True)
    # Start-up in parallel: Prefect's temporary API server (a subprocess) starts in a thread, the driver's heavy
    # imports in another, while this thread starts the run's Placement: the local Ray and in it the trainer ranks'
    # actors (and the separate rollout engines'), which the flow's Cluster then takes over (and stops) as if it had
    # started them. A user's PREFECT_API_URL or Ray address is used as before.
    #
    # This thread's first Ray actor (start_actors_early) makes Ray build its serializers, which import pydantic.v1,
    # while the threads below import Prefect's server and transformers, which import it too. pydantic.v1 imports its
    # own submodules from its package's __init__, and two threads importing it at once can fail (KeyError:
    # 'pydantic.v1', 1 `posttrain run` in ~25): it is imported here, before any thread starts (13 ms).
    import pydantic.v1  # noqa: F401

    from infra.cluster.placement import Placement

    placement = Placement(cfg)
    api = _start_temporary_api()
    imports = threading.Thread(target=_import_ahead, name="posttrain-imports", daemon=True)
    imports.start()
    try:
        if placement.start_ray_early():
            startup.mark("local_ray")
            try:
                placement.start_actors_early()
            except Exception as exc:  # noqa: BLE001 - the flow's Cluster places them instead, and reports its failures
                log.warning("posttrain run: the actors were not started ahead (%s: %s); the flow places them",
                            type(exc).__name__, redact_text(str(exc)))
        if api is not None:
            api.join()  # a failed start is retried, and reported, by the flow's own client
            startup.mark("prefect_api")
        # The flow starts once the imports ahead are done: transformers' lazy module can refuse a name to a thread
        # that imports it while another thread still does ("cannot import name 'AutoTokenizer' from
        # 'transformers'"). Joining a Ray cluster with an API URL given waits for nothing above, so the flow would
        # reach its tokenizer mid-import.
        imports.join()
        # named job.name when it is created (a deployment's run is renamed by the flow: flows.params.open_run)
        flow = flow_for(cfg.rl.objective).with_options(flow_run_name=lambda: cfg.job.name)
        with placement.offered():  # the flow's Cluster takes it over
            return flow(recipe=str(recipe), overrides=list(overrides))
    finally:
        placement.close()  # what no Cluster took: the actors started ahead, and the local Ray


def _start_temporary_api() -> threading.Thread | None:
    """Start the temporary Prefect API server the flow would start (no PREFECT_API_URL set), in a thread: Prefect's
    `get_client()` starts it when no API URL is set, and keeps one such server per process, which the flow's own
    client then finds running."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None

    def start() -> None:
        with contextlib.suppress(Exception):
            # in this thread, while Ray starts: get_client imports the server's package (~2 s) and starts it
            from prefect.client.orchestration import get_client

            client = get_client(sync_client=True)  # returns once the server answers /health
            pid = child_listening_on(client.api_url.port)
            if pid is not None:
                # its bookkeeping (every task run's events) yields the CPU to the trainer and engine actors
                os.setpriority(os.PRIO_PROCESS, pid, min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19))

    thread = threading.Thread(target=start, name="posttrain-prefect-api", daemon=True)
    thread.start()
    return thread


def _import_ahead() -> None:
    """What the flow imports first (tokenizers, models, MLflow): loaded while the API server starts."""
    with contextlib.suppress(Exception):
        import mlflow  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
