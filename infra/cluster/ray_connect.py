"""Joining a Ray cluster, or starting a local one: loopback, token authentication, clear failures.

`connect_ray(cfg)` is what a run's `infra.cluster.placement.Placement` calls first (`start_local_ray` when `posttrain run`
starts the local Ray ahead of the flow); `infra/cluster/cluster.py` places the roles once Ray is up.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import ray
import torch

from infra.processes import OPENMP_ENV
from rl_core.config import PosttrainConfig
from rl_core.placement.run_shape import num_engines

log = logging.getLogger("posttrain.cluster")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
# What the actors would draw into the driver's progress display (Ray streams their output to it): the tqdm bars of
# vLLM, of transformers' checkpoint-shard loading and of hub downloads. Their logs and errors still come through.
QUIET_ACTOR_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _address_host(address: str) -> str:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


def keep_ray_on_loopback() -> None:
    """Make Ray use 127.0.0.1 as this machine's node IP (a local Ray, or a cluster on 127.0.0.1).

    Ray otherwise replaces 127.0.0.1 by the address of the interface that routes outwards, also for
    `ray.init(_node_ip_address="127.0.0.1")`; with it a head started on 127.0.0.1 (whose GCS then
    listens on loopback only) cannot be reached. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is Ray's
    switch for that; it is read once at import, so the module constant is set too. Processes that
    Ray starts from here inherit the environment variable.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def auth_token_source() -> str | None:
    """Where this process takes a Ray auth token from: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or
    ~/.ray/auth_token under RAY_AUTH_MODE=token; None when it sends none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    default = Path.home() / ".ray" / "auth_token"
    token_mode = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    return str(default) if token_mode and default.is_file() else None


def actor_runtime_env() -> dict:
    """The job-level runtime_env of the run's Ray actors: `QUIET_ACTOR_ENV`, less any variable this process sets
    itself, and OpenMP's wait policy (`infra.processes.OPENMP_ENV`, this process's own value where set, so the
    actors of a cluster on other nodes run with the driver's); less any variable the Ray job it runs in
    (`ray job submit --runtime-env-json`) sets: a user's own value wins, and Ray refuses to merge a job's env_vars
    with a driver's that name the same variable."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    taken = set((job.get("runtime_env") or {}).get("env_vars") or {})
    env = {k: v for k, v in QUIET_ACTOR_ENV.items() if k not in os.environ}
    env.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})
    return {"env_vars": {k: v for k, v in env.items() if k not in taken}}


def quiet_token_auth() -> None:
    """Token authentication for a local Ray of our own, as Ray's default, without its notice.

    Ray turns token authentication on for a new local cluster when RAY_AUTH_MODE is unset, and then logs "Token
    authentication is enabled for this Ray cluster ..." into the run's output; with the mode set explicitly (what
    its notice asks for) it logs nothing. A user's own RAY_AUTH_MODE is left as it is.
    """
    if "RAY_AUTH_MODE" not in os.environ:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()  # RAY_AUTH_MODE=token, and the config this process already read is refreshed


def connect_ray(cfg: PosttrainConfig) -> bool:
    """Join `cluster.address` / `RAY_ADDRESS`, or start a local Ray of our own; True when we started it.

    A Ray already initialised in this process (tests, notebooks) is used as it is. With no address
    the local Ray is started with `address="local"`, so a cluster that `ray start` left on this
    machine is never joined by accident. A cluster on 127.0.0.1 is reached on 127.0.0.1. Joining a
    cluster with token authentication takes the token from RAY_AUTH_TOKEN or the file that
    RAY_AUTH_TOKEN_PATH names (either switches RAY_AUTH_MODE=token on when it is unset), or from
    ~/.ray/auth_token with RAY_AUTH_MODE=token.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        if _address_host(address) in LOOPBACK_HOSTS:
            keep_ray_on_loopback()
        # An explicit address never turns token mode on in Ray. A token the user put in the environment says
        # they want it; a ~/.ray/auth_token left by some local Ray does not (the cluster may have auth off).
        if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN")
                                                  or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            from ray._private.authentication.authentication_token_setup import _enable_token_auth

            _enable_token_auth()  # RAY_AUTH_MODE=token, and the config this process already read is refreshed
        try:
            ray.init(address=address, log_to_driver=True, configure_logging=False, runtime_env=actor_runtime_env())
        except Exception as exc:
            raise ConnectionError(_join_failure(address, exc)) from exc
        log.info("joined Ray cluster at %s", address)
        return False
    start_local_ray(cfg)
    return True


def start_local_ray(cfg: PosttrainConfig) -> None:
    """A local Ray of our own on 127.0.0.1, with at least the CPUs the run's roles reserve."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    keep_ray_on_loopback()
    quiet_token_auth()
    c = cfg.cluster
    need = c.num_workers * c.cpus_per_worker + (
        num_engines(cfg) * c.cpus_per_engine if c.placement == "separate" else 0)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = _children()
        try:
            ray.init(address="local", include_dashboard=False,
                     num_cpus=max(math.ceil(need), os.cpu_count() or 1), num_gpus=torch.cuda.device_count(),
                     log_to_driver=True, configure_logging=False, runtime_env=actor_runtime_env(),
                     _system_config=LOCAL_SYSTEM_CONFIG)
            break
        except Exception as exc:
            if attempt == LOCAL_START_ATTEMPTS or NODE_START_TIMEOUT not in str(exc):
                raise
            # Ray waits a fixed 30 s for its raylet to register; a busy machine can take longer. What this attempt
            # started (GCS, raylet, agents) is stopped, so the next one is the only local Ray.
            stopped = _stop_children_since(before)
            log.warning("the local Ray did not come up within Ray's 30 s (a busy machine?): stopped the %d "
                        "processes it started, starting it again (attempt %d of %d)", stopped, attempt + 1,
                        LOCAL_START_ATTEMPTS)
    log.info("started a local Ray on 127.0.0.1")


LOCAL_START_ATTEMPTS = 3
# Ray prestarts idle Python workers when the first driver connects. The run's actors never take them (their job-level
# runtime_env, `actor_runtime_env`, asks for workers of their own), so on a local Ray they only cost CPU: each imports
# Ray at start-up and then polls while idle.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
NODE_START_TIMEOUT = "timed out during startup"  # ray._private.node.Node's message when the raylet is late


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop_children_since(before: set[int]) -> int:
    """Kill this process's descendants that are not in `before` (what a failed `ray.init` left); their count."""
    import psutil

    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for proc in new:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(new, timeout=10)
    return len(new)


def _join_failure(address: str, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    while exc.__cause__ is not None or exc.__context__ is not None:  # the auth error is often the cause
        exc = exc.__cause__ or exc.__context__
        text += f" <- {type(exc).__name__}: {exc}"
    hint = ""
    if "auth" in text.lower() or "token" in text.lower():
        source = auth_token_source()
        hint = (" The cluster uses token authentication: give this process the cluster's token (on the head node: "
                "`ray get-auth-token`) as RAY_AUTH_TOKEN, or as a file named by RAY_AUTH_TOKEN_PATH, or in "
                "~/.ray/auth_token together with RAY_AUTH_MODE=token. "
                + (f"A token was taken from {source} and refused: it is not this cluster's token."
                   if source else "No token is set here."))
    return f"could not join the Ray cluster at cluster.address/RAY_ADDRESS={address!r}: {text}.{hint}"

