"""`posttrain services up|down|status` and `posttrain deploy`.

    posttrain services up        Prefect server + work pool posttrain-process + worker, MLflow server (127.0.0.1)
    posttrain services status    what runs, its pid, URL and log
    posttrain services down      stop exactly those processes
    posttrain deploy             `prefect deploy --all` (prefect.yaml) against the services' Prefect API

State (pid files, logs, databases, services.env) lives in $POSTTRAIN_STATE_DIR, default
`.posttrain/services/`; see infra/services/supervisor.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from infra.services.supervisor import PROJECT_DIR_ENV, Services, ServicesError, project_dir, venv_bin


def cmd_services(args: argparse.Namespace) -> int:
    services = Services.at(args.state_dir)
    try:
        if args.action == "up":
            services.up(prefect_port=args.prefect_port, mlflow_port=args.mlflow_port)
        elif args.action == "down":
            services.down()
        else:
            print("\n".join(services.status()))
            return 0 if all(services.running().values()) else 3
    except ServicesError as exc:
        print(f"posttrain services {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def deploy_all(services: Services, *, names: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `prefect deploy --all` (or `--name` each of `names`) in the project against the services' API."""
    variables = services.env()  # raises ServicesError when the services are not up
    project = project_dir()
    env = {**os.environ, **variables, PROJECT_DIR_ENV: str(project)}
    env.pop("PREFECT_PROFILE", None)
    env["PREFECT_HOME"] = str(services.prefect_home)
    cmd = [venv_bin("prefect"), "--no-prompt", "deploy", "--prefect-file", str(project / "prefect.yaml")]
    cmd += [a for n in names for a in ("--name", n)] if names else ["--all"]
    return subprocess.run(cmd, cwd=project, env=env, text=True, capture_output=True, timeout=600,
                          check=False)


def deployment_pools(names: list[str] | None = None) -> list[str]:
    """The work pools prefect.yaml's deployments (those of `names`, `flow/deployment`, else all) go to."""
    import yaml

    spec = yaml.safe_load((project_dir() / "prefect.yaml").read_text())
    pools = {d["work_pool"]["name"] for d in spec.get("deployments") or []
             if (d.get("work_pool") or {}).get("name") and (not names or any(
                 n == d.get("name") or n.endswith("/" + str(d.get("name"))) for n in names))}
    return sorted(pools)


def cmd_deploy(args: argparse.Namespace) -> int:
    from infra.services.work_pools import pool_warnings

    services = Services.at(args.state_dir)
    try:
        out = deploy_all(services, names=args.name or None)
        variables = services.env()
    except ServicesError as exc:
        print(f"posttrain deploy: {exc}", file=sys.stderr)
        return 1
    # a pool made with Prefect's default template lets any caller of the API choose the command a run executes
    for warning in pool_warnings(variables["PREFECT_API_URL"], variables.get("PREFECT_API_AUTH_STRING"),
                                 deployment_pools(args.name)):
        print(f"posttrain deploy: warning: {warning}", file=sys.stderr)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        print(f"posttrain deploy: `prefect deploy` exited {out.returncode}", file=sys.stderr)
    return out.returncode


def add_service_commands(subparsers) -> None:
    p = subparsers.add_parser("services", help="start/stop/status of the local Prefect server, worker and MLflow server")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--state-dir", default=None, help="default: $POSTTRAIN_STATE_DIR or .posttrain/services")
    p.add_argument("--prefect-port", type=int, default=None, help="default: $POSTTRAIN_PREFECT_PORT or 4200 (if free)")
    p.add_argument("--mlflow-port", type=int, default=None, help="default: $POSTTRAIN_MLFLOW_PORT or 5000 (if free)")
    p.set_defaults(handler=cmd_services)
    p = subparsers.add_parser("deploy", help="`prefect deploy --all` with prefect.yaml against `posttrain services`")
    p.add_argument("--state-dir", default=None, help="default: $POSTTRAIN_STATE_DIR or .posttrain/services")
    p.add_argument("--name", action="append", help="deploy only this deployment (repeatable), e.g. grpo/arithmetic")
    p.set_defaults(handler=cmd_deploy)
