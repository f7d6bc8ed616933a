"""`posttrain run-params`: the command the DVC `train` stage calls.

    posttrain run-params RECIPE [KEY=VALUE ...] [--params params.yaml] [--section train] [--run-dir DIR]
                         [--dry-run]

It runs `posttrain run RECIPE -- <overrides>`, where the overrides are the `train:` section of params.yaml
flattened to dotted keys (`train: {rl: {optimizer: {lr: 2e-4}}}` -> `rl.optimizer.lr=0.0002`), then the
KEY=VALUE items of the command line. The section mirrors the config's key paths, so DVC sees each
hyperparameter as its own parameter: `dvc exp run -S train.rl.optimizer.lr=2e-4` varies one and
`dvc exp show` compares runs by it. The overrides go through the config loader like any other, so a
misspelt key in params.yaml is reported naming it, with the closest valid keys, before anything starts.
`--dry-run` prints the resolved value of every key it set and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

TYPE_KEY = "rl.objective.type"  # first: switching the objective keeps the knobs set after it (loader._switch_objective)


def _text(value: Any) -> str:
    """A params.yaml value as dotlist text that the loader parses back to the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)  # lists and mappings: JSON is YAML flow style


def flatten_section(tree: dict[str, Any]) -> list[str]:
    """`{rl: {optimizer: {lr: 1e-4}}}` -> `["rl.optimizer.lr=0.0001"]`, in file order (`rl.objective.type` first).

    A mapping is descended into unless its dotted key is itself a config leaf (`rl.objective.kwargs`,
    a dict-valued field), which is passed whole."""
    from rl_core.config.explain import all_keys

    leaves = set(all_keys())
    out: list[tuple[str, str]] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and prefix not in leaves:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out.append((prefix, _text(node)))

    walk(tree, "")
    out.sort(key=lambda kv: kv[0] != TYPE_KEY)  # stable: the rest keep the file's order
    return [f"{key}={value}" for key, value in out]


def params_overrides(params_path: str | Path, section: str) -> list[str]:
    """The overrides of the `section` mapping of a params file (dotted `section` allowed); [] when it is empty."""
    import yaml

    path = Path(params_path)
    if not path.is_file():
        raise ValueError(f"{path}: no such params file")
    node: Any = yaml.safe_load(path.read_text()) or {}
    for part in section.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{path}: no key {section!r}; it holds the config values of the run, e.g. "
                             f"{section}: {{rl: {{max_steps: 50}}}}")
        node = node[part]
    if node is None:
        return []
    if not isinstance(node, dict):
        raise TypeError(f"{path}: {section} must be a mapping of config keys (rl: {{optimizer: {{lr: ...}}}}), "
                         f"got {node!r}")
    return flatten_section(node)


def cmd_run_params(args: argparse.Namespace) -> int:
    from rl_core.config import ConfigError, load_config
    from rl_core.config.loader import flatten
    from rl_core.redact import redact_message

    try:
        from_params = params_overrides(args.params, args.section)
        overrides = from_params + list(args.fixed)
        print(redact_message(f"run-params: posttrain run {args.recipe} -- {' '.join(overrides)}"), flush=True)
        try:
            cfg = load_config(args.recipe, overrides)
        except ConfigError as exc:  # name a params.yaml key as it is written there: train.rl.optimizer.lr
            keys = {item.split("=", 1)[0].strip() for item in from_params}
            raise ConfigError([f"{args.section}.{p}" if re.split("[:=]", p, maxsplit=1)[0] in keys else p
                               for p in exc.problems], f"{args.recipe} with {args.params}") from None
        if args.run_dir is not None and Path(cfg.run_dir).resolve() != Path(args.run_dir).resolve():
            raise ValueError(f"the run directory is {cfg.run_dir!r} but this stage's outputs are under "
                             f"{args.run_dir!r}; keep job.name/job.out_dir or change dvc.yaml")
        if args.dry_run:
            resolved = flatten(cfg)
            for key in dict.fromkeys(item.split("=", 1)[0].strip() for item in overrides):
                print(redact_message(f"{key}={json.dumps(resolved.get(key))}"))
            return 0
        from flows.entry import run_recipe

        run_recipe(args.recipe, overrides)
    except (ValueError, TypeError, ConfigError) as exc:
        print(redact_message(f"posttrain run-params: {exc}"), file=sys.stderr)
        return 1
    return 0


def add_params_command(subparsers) -> None:
    """Register `run-params` on `subparsers`."""
    p = subparsers.add_parser(
        "run-params", help="posttrain run RECIPE with the config values of params.yaml's train: section "
                           "(the DVC train stage)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples (overrides here come without `--`, after the params file's values):\n"
               "  posttrain run-params recipes/arithmetic.py --dry-run\n"
               "  posttrain run-params recipes/arithmetic.py rl.optimizer.lr=2e-4 rl.max_steps=50 --run-dir "
               "runs/arithmetic\n"
               "  dvc exp run -S train.rl.optimizer.lr=2e-4   # the same values through DVC (docs/dvc.md)")
    p.add_argument("recipe", help="recipes/<name>.py")
    p.add_argument("fixed", nargs="*", metavar="KEY=VALUE", help="overrides applied after the params file's")
    p.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    p.add_argument("--section", default="train", help="dotted key of the section of config values (default train)")
    p.add_argument("--run-dir", default=None, help="fail unless the resolved run directory is this one")
    p.add_argument("--dry-run", action="store_true", help="print the resolved value of each key set; run nothing")
    p.set_defaults(handler=cmd_run_params)
