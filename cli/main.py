"""The `posttrain` command line.

    posttrain validate RECIPE [-- key=value ...]   print the resolved config, the preflight report and the memory plan
    posttrain run RECIPE [-- key=value ...]        run the recipe's flow (GRPO family, OPD or DPO)
    posttrain init-model | warm-start | make-data  build the tiny model and data (what the DVC stages call)
    posttrain summarize RUN_DIR | run-params        DVC metrics/plots of a run; a run with params.yaml overrides

Overrides come as a dotlist after `--`, e.g. `posttrain run recipes/arithmetic.py -- rl.max_steps=20`.
"""

from __future__ import annotations

import argparse
import os
import sys


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def cmd_validate(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from rl_core.config import ConfigError, load_config
    from rl_core.config.loader import config_dict, config_hash
    from rl_core.config.preflight import preflight
    from rl_core.redact import redact, redact_message

    try:
        cfg = load_config(args.recipe, overrides)
    except ConfigError as exc:
        print(redact_message(str(exc)), file=sys.stderr)
        return 1
    report = preflight(cfg)
    # every value a URI may carry credentials in (data, models, addresses) is printed through the redactor
    print(yaml.safe_dump(redact(config_dict(cfg)), sort_keys=False, default_flow_style=False), end="")
    print(f"# config hash: {config_hash(cfg)}")
    print(redact_message(report.render()), file=sys.stderr if report.errors else sys.stdout)
    memory_ok = print_memory_plan(cfg)
    return 0 if report.ok and memory_ok else 1


def print_memory_plan(cfg) -> bool:
    """Print the preflight memory plan (or why there is none); False when a GPU role does not fit its GPU or a node's
    host memory its RAM."""
    import os

    from rl_core.config.environment import planned_memory
    from rl_core.placement.memory import plan_for_config
    from rl_core.redact import redact_message

    remote = bool(cfg.cluster.address or os.environ.get("RAY_ADDRESS"))
    plan, why = plan_for_config(cfg, **planned_memory(cfg, remote_ray=remote))
    if plan is None:
        print(redact_message(f"memory plan: none ({why})"))
        return True
    print(redact_message(plan.render()))
    problems = plan.problems()
    for problem in problems:
        print(redact_message(f"  memory error: {problem}"), file=sys.stderr)
    return not problems


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rl_core.config import ConfigError
    from rl_core.redact import redact_message

    try:
        from flows.entry import run_recipe

        result = run_recipe(args.recipe, overrides)
    except ConfigError as exc:
        print(redact_message(str(exc)), file=sys.stderr)
        return 1
    print(summary_line(result))
    return 0


# What posttrain and its children (Ray workers, services) write is the user's only: files 0600, directories 0700
# (run directories hold configs, metrics, checkpoints and logs; MLflow's local store has no authentication).
PRIVATE_UMASK = 0o077


def summary_line(result: dict) -> str:
    """One line a person reads at the end of a run: held-out accuracy first -> last, and where things are."""
    from infra.tracking import MetricsLog

    records = MetricsLog(result["metrics"]).read()
    acc = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    trend = f"held-out accuracy {acc[0][1]:.3f} (step {acc[0][0]}) -> {acc[-1][1]:.3f} (step {acc[-1][0]}); " if acc else ""
    return (f"{trend}metrics: {result['metrics']}; run directory: {result['run_dir']}; "
            f"MLflow run {result.get('mlflow_run_id')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="RL post-training pipeline (Prefect flows on Ray).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="print the resolved config, the preflight report and the memory plan "
                                      "(exit 1 on errors or when a GPU role does not fit its GPU)")
    p.add_argument("recipe", help="recipes/<name>.py or a config_resolved.yaml")
    p.set_defaults(handler=cmd_validate)
    p = sub.add_parser("run", help="run a recipe's flow")
    p.add_argument("recipe", help="recipes/<name>.py or a config_resolved.yaml")
    p.set_defaults(handler=cmd_run)
    from cli.build import add_build_commands
    from cli.export import add_export_command
    from cli.report import add_report_commands
    from cli.services import add_service_commands

    add_build_commands(sub)
    add_report_commands(sub)
    add_service_commands(sub)
    add_export_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.umask(PRIVATE_UMASK)
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = _split_overrides(argv)
    args = build_parser().parse_args(own)
    if args.command in ("validate", "run"):
        return args.handler(args, overrides)
    if overrides:
        print(f"posttrain {args.command}: takes no '-- overrides'", file=sys.stderr)
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
