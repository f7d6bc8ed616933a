"""The `posttrain` command line.

    posttrain validate RECIPE... [-- key=value ...] print the resolved config, the preflight report and the memory plan
    posttrain run RECIPE [-- key=value ...]        run the recipe's flow (GRPO family, OPD or DPO)
    posttrain init-model | warm-start | make-data  build the tiny model and data (what the DVC stages call)
    posttrain summarize RUN_DIR | run-params        DVC metrics/plots of a run; a run with params.yaml's train: values
    posttrain keys [PREFIX] [--type T]              the config keys with type, default and description

Overrides come as a dotlist after `--`, e.g. `posttrain run recipes/arithmetic.py -- rl.max_steps=20`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from infra.processes import passive_openmp

# the `-- key=value` form, shown at the end of `posttrain --help`, `run --help` and `validate --help`
OVERRIDE_EXAMPLES = """\
overrides: a dotlist after `--` (list the keys with `posttrain keys`), e.g.
  posttrain {cmd} recipes/arithmetic.py -- rl.optimizer.lr=2e-4 rl.max_steps=50
  posttrain {cmd} recipes/gspo_gsm8k.py -- rl.objective.epsilon_high=5e-4 rollout.temperature=0.8
  posttrain {cmd} recipes/arithmetic.py -- "data.rewards=[{{path: 'my_pkg.rewards:correct', weight: 1.0}}]"
"""
OVERRIDE_COMMANDS = ("validate", "run")


def _shell_join(words: list[str]) -> str:
    """Words as a shell line: bare when safe, else in double quotes when nothing in them is special there (the
    README's `"data.rewards=[{path: '...'}]"`), else shlex's quoting."""
    def quote(word: str) -> str:
        if shlex.quote(word) == word:
            return word
        return f'"{word}"' if not any(c in word for c in '"$`\\!') else shlex.quote(word)
    return " ".join(quote(w) for w in words)


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def cmd_validate(args: argparse.Namespace, overrides: list[str]) -> int:
    """Each recipe in turn, in this one process (`make demo` checks every recipe so: a process per recipe pays
    seconds of imports each); the exit status is the worst."""
    several = len(args.recipe) > 1
    worst = 0
    for recipe in args.recipe:
        if several:
            print(f"# ===== {recipe}", flush=True)
        code = validate_recipe(recipe, overrides, no_env=args.no_env)
        if code and several:
            print(f"posttrain validate: {recipe} has errors (above)", file=sys.stderr, flush=True)
        worst = max(worst, code)
    return worst


def validate_recipe(recipe: str, overrides: list[str], no_env: bool) -> int:
    import yaml

    from rl_core.config import ConfigError, load_config
    from rl_core.config.loader import config_dict, config_hash
    from rl_core.preflight.rows import check_data
    from rl_core.preflight.rules import preflight
    from rl_core.redact import redact, redact_message

    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as exc:
        print(redact_message(str(exc)), file=sys.stderr)
        return 1
    report = preflight(cfg)
    if report.ok and not no_env:  # what `run` checks next (rl_core.preflight.rules.check): this machine
        from rl_core.preflight.machine import machine_problems

        report.errors.extend(machine_problems(cfg))
    # every value a URI may carry credentials in (data, models, addresses) is printed through the redactor
    print(yaml.safe_dump(redact(config_dict(cfg)), sort_keys=False, default_flow_style=False), end="")
    print(f"# config hash: {config_hash(cfg)}")
    print(redact_message(report.render()), file=sys.stderr if report.errors else sys.stdout)
    # the rows `run` reads, every bad one (a hub id: not with --no-env); an environment's first episode, opened
    data = check_data(cfg, read_hub=not no_env, open_episode=True)
    print(redact_message(data.render()), file=sys.stderr if data.errors else sys.stdout)
    memory_ok = print_memory_plan(cfg, reported=report.errors)
    return 0 if report.ok and data.ok and memory_ok else 1


def print_memory_plan(cfg, reported: list[str] = ()) -> bool:
    """Print the preflight memory plan (or why there is none); False when a GPU role does not fit its GPU or a node's
    host memory its RAM. A problem already in `reported` (the machine checks') is not printed twice."""
    import os

    from rl_core.placement.memory import plan_for_config
    from rl_core.preflight.machine import planned_memory
    from rl_core.redact import redact_message

    remote = bool(cfg.cluster.address or os.environ.get("RAY_ADDRESS"))
    plan, why = plan_for_config(cfg, **planned_memory(cfg, remote_ray=remote))
    if plan is None:
        print(redact_message(f"memory plan: none ({why})"))
        return True
    print(redact_message(plan.render()))
    problems = plan.problems()
    for problem in problems:
        if problem not in reported:
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
    """One line a person reads at the end of a run: held-out accuracy first -> last (and the reward whose full marks
    it counts, `data.success_reward`), and where things are."""
    from infra.tracking.tracker import MetricsLog
    from rl_core.rewards import SUCCESS_VALUE

    records = MetricsLog(result["metrics"]).read()
    acc = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    counts = f" ({result['success_reward']} >= {SUCCESS_VALUE:g})" if result.get("success_reward") else ""
    trend = (f"held-out accuracy{counts} {acc[0][1]:.3f} (step {acc[0][0]}) -> {acc[-1][1]:.3f} (step {acc[-1][0]}); "
             if acc else "")
    return (f"{trend}metrics: {result['metrics']}; run directory: {result['run_dir']}; "
            f"MLflow run: {result.get('mlflow_url') or result.get('mlflow_run_id')}")


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="posttrain", description="RL post-training pipeline (Prefect flows on Ray).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OVERRIDE_EXAMPLES.format(cmd="run"))
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('posttrain')}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="print the resolved config, the preflight report and the memory plan "
                                      "(exit 1 on errors or when a GPU role does not fit its GPU)",
                       description="Check a recipe as `posttrain run` does before it starts anything: the config, "
                                   "the rules across fields, this machine (GPUs, vLLM, the model, the data), "
                                   "the memory plan, and every row of the data splits (each bad one listed).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=OVERRIDE_EXAMPLES.format(cmd="validate"))
    p.add_argument("recipe", nargs="+", help="recipes/<name>.py or a config_resolved.yaml; several are checked in "
                                             "turn, each with the same overrides")
    p.add_argument("--no-env", action="store_true",
                   help="check the config alone: skip the checks of this machine (GPUs, vLLM, model and data "
                        "paths), e.g. to validate a GPU recipe on a laptop; local data files are still read, a hub "
                        "dataset is not fetched")
    p.set_defaults(handler=cmd_validate)
    p = sub.add_parser("run", help="run a recipe's flow", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=OVERRIDE_EXAMPLES.format(cmd="run"))
    p.add_argument("recipe", help="recipes/<name>.py or a config_resolved.yaml")
    p.set_defaults(handler=cmd_run)
    from cli.build import add_build_commands
    from cli.export import add_export_command
    from cli.keys import add_keys_command
    from cli.params import add_params_command
    from cli.report import add_report_commands
    from cli.services import add_service_commands

    add_keys_command(sub)
    add_build_commands(sub)
    add_report_commands(sub)
    add_params_command(sub)
    add_service_commands(sub)
    add_export_command(sub)
    return parser


def user_code_on_path() -> None:
    """Put the working directory on `sys.path`, after the installed packages (a file there never shadows one), as
    `python -m` does: a recipe's `data.rewards`, `data.task` or `rl.objective.import_path` may name a module beside
    it (`my_rewards:correct`) without installing it. The Ray workers of this driver get the same directory: Ray
    puts the driver's working directory on their path."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def main(argv: list[str] | None = None) -> int:
    os.umask(PRIVATE_UMASK)
    passive_openmp()  # before anything imports torch: its OpenMP runtime reads the wait policy once, when loaded
    user_code_on_path()
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = _split_overrides(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(own)
    if args.command == "validate":  # its recipes are a list, which would take a forgotten `--`'s key=value too
        stray = [r for r in args.recipe if "=" in r and not os.path.exists(r)]
        args.recipe = [r for r in args.recipe if r not in stray]
        extra = [*stray, *extra]
    if extra:
        if args.command in OVERRIDE_COMMANDS and all("=" in a and not a.startswith("-") for a in extra):
            # `posttrain run recipe k=v` (the `--` forgotten): say what was meant rather than "unrecognized"
            rest = [a for a in own if a not in extra]
            print(f"posttrain {args.command}: overrides go after `--`; did you mean: "
                  f"posttrain {_shell_join(rest)} -- {_shell_join(extra + overrides)}?", file=sys.stderr)
            return 2
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in OVERRIDE_COMMANDS:
        return args.handler(args, overrides)
    if overrides:
        print(f"posttrain {args.command}: takes no '-- overrides'", file=sys.stderr)
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
