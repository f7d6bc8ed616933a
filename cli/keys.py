"""`posttrain keys [PREFIX] [--type T]`: every config key with its type, default and description, from the schema.

The rows come from the pydantic models themselves (`model_fields`, walked recursively), so a new field shows up
here with its description and nothing is written twice. `rl.objective` is a union told apart by `type`: its keys
are listed per objective type (all of them, or the `--type` given).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rl_core.config.explain import OBJECTIVE_KEY, section_model


def type_name(annotation: Any) -> str:
    """`int | None`, `'hf' | 'vllm'`, `list[str]`: the annotation as a person writes it."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def default_text(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return repr(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)
    return "(required)" if field.default is PydanticUndefined else repr(field.default)


def key_rows(model: type[BaseModel] | None = None, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """`(key, objective type or '', type, default, description)` for every leaf of the config tree; the keys of
    `rl.objective` once per objective type that has them."""
    from rl_core.algorithms.registry import OBJECTIVES
    from rl_core.config.schema import PosttrainConfig

    rows = []
    for name, field in (model or PosttrainConfig).model_fields.items():
        dotted = f"{prefix}{name}"
        if dotted == OBJECTIVE_KEY:
            for kind, cls in OBJECTIVES.items():
                for knob, f in cls.model_fields.items():
                    rows.append((f"{dotted}.{knob}", kind, type_name(f.annotation), default_text(f),
                                 f.description or ""))
        elif (sub := section_model(field.annotation)) is not None:
            rows.extend(key_rows(sub, dotted + "."))
        else:
            rows.append((dotted, "", type_name(field.annotation), default_text(field), field.description or ""))
    return rows


def render(rows: list[tuple[str, str, str, str, str]]) -> str:
    """Aligned columns, the objective's keys under a `rl.objective.type=<kind>` heading each."""
    if not rows:
        return ""
    wk = max(len(r[0]) for r in rows)
    wt = min(max(len(r[2]) for r in rows), 36)
    wd = min(max(len(r[3]) for r in rows), 28)
    lines, kind = [], None
    for key, k, typ, default, desc in rows:
        if k != kind and k:
            lines.append(f"# {OBJECTIVE_KEY}.type={k}")
        kind = k
        lines.append(f"{key:<{wk}}  {typ:<{wt}}  {default:<{wd}}  {desc}".rstrip())
    return "\n".join(lines)


def cmd_keys(args: argparse.Namespace) -> int:
    from rl_core.config.explain import closest_keys

    rows = key_rows()
    if args.type:
        rows = [r for r in rows if not r[1] or r[1] == args.type]
    if args.prefix:
        p = args.prefix.rstrip(".")
        rows = [r for r in rows if r[0] == p or r[0].startswith(p + ".")]
        if not rows:
            close = closest_keys(p)
            hint = f"; closest keys: {', '.join(close)}" if close else ""
            print(f"posttrain keys: no key {p!r} or under it{hint}", file=sys.stderr)
            return 1
    print(render(rows))
    return 0


def add_keys_command(subparsers) -> None:
    from rl_core.algorithms.registry import OBJECTIVES

    p = subparsers.add_parser(
        "keys", help="list the config keys with type, default and description (what `-- key=value` may set)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  posttrain keys                        every key\n"
               "  posttrain keys rl.optimizer           the keys under rl.optimizer\n"
               "  posttrain keys rl.objective --type gspo   the knobs of one objective type\n"
               "then set one: posttrain run recipes/arithmetic.py -- rl.optimizer.lr=2e-4")
    p.add_argument("prefix", nargs="?", default=None, help="a dotted key or section, e.g. rl.optimizer")
    p.add_argument("--type", choices=sorted(OBJECTIVES), default=None,
                   help="only this objective type's rl.objective keys")
    p.set_defaults(handler=cmd_keys)
