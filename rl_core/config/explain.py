"""Explaining configuration problems: `ConfigError`, the keys a config has, the closest known key to a mistyped one
(with the aliases of TRL and of other objectives), retired keys and values, and one line per pydantic error naming
the dotted key (docs/config.md). `rl_core.config.loader` builds configs and reports through these."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from rl_core.algorithms.registry import OBJECTIVES
from rl_core.config.aliases import ALIASES, alias_hint, alias_key
from rl_core.config.legacy import FOLDED_KEYS, MOVED_KEYS, folded_key_message, moved_key_message
from rl_core.config.schema import PosttrainConfig, RewardEntry
from rl_core.redact import redact_text, redact_uri

# Retired keys are unknown keys: nothing is aliased, the error names the replacement.
RETIRED_KEYS: dict[str, dict[str | None, str]] = {
    "rl.objective": {  # once a name, now the objective's section
        "degenerate": "rl.objective.type=legacy_pg",
        "clipped": "rl.objective.type=grpo",
        None: "rl.objective.type=grpo|dr_grpo|gspo|legacy_pg|opd|dpo|custom",
    },
    "model.dtype": {
        "float16": "model.compute_dtype=bfloat16 (float16 without loss scaling is not supported)",
        None: "model.compute_dtype=float32|bfloat16 (parameters and optimizer state are always float32)",
    },
    "rl.objective_mode": {
        "direct": "rl.objective.distillation_mode=direct",
        "advantage": "rl.objective.distillation_mode=advantage",
        None: "rl.objective.distillation_mode=advantage|direct",
    },
}
# Values that name a variant which is a knob of another key, not a value of this one.
ENUM_HINTS: dict[tuple[str, str], str] = {
    ("rl.objective.importance_sampling_level", "sequence"): "sequence-level ratios are GSPO: rl.objective.type=gspo",
    ("rl.objective.surrogate", "legacy_pg"): "the ratio-free policy gradient is rl.objective.type=legacy_pg",
}
OBJECTIVE_KEY = "rl.objective"


class ConfigError(ValueError):
    """One or more configuration problems; `.problems` lists them, each naming a dotted key. Every problem passes
    through the redactor: a value quoted back (a model, data or address URI) never carries its credentials."""

    def __init__(self, problems: Iterable[str], source: str | None = None):
        self.problems = [redact_text(str(p)) for p in problems]
        head = f"invalid configuration{f' ({source})' if source else ''}: {len(self.problems)} problem(s)"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in self.problems))


# ----------------------------------------------------------------------------------------- keys


def _section_fields(model: type[BaseModel]) -> dict[str, Any]:
    return dict(model.model_fields)


def section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def objective_keys() -> dict[str, Any]:
    """The keys of `rl.objective`: every objective class's fields (the first class that declares one)."""
    fields: dict[str, Any] = {}
    for cls in OBJECTIVES.values():
        for name, field in cls.model_fields.items():
            fields.setdefault(name, field)
    return fields


def all_keys(model: type[BaseModel] = PosttrainConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config tree, e.g. `rl.optimizer.lr` (`rl.objective.*`: of every objective)."""
    keys: list[str] = []
    for name, field in _section_fields(model).items():
        sub = section_model(field.annotation)
        dotted = f"{prefix}{name}"
        if dotted == OBJECTIVE_KEY:
            keys.extend(f"{dotted}.{k}" for k in objective_keys())
        else:
            keys.extend(all_keys(sub, dotted + ".") if sub else [dotted])
    return keys


def field_for(dotted: str) -> Any | None:
    if dotted.startswith(OBJECTIVE_KEY + "."):
        return objective_keys().get(dotted[len(OBJECTIVE_KEY) + 1:])
    model: type[BaseModel] | None = PosttrainConfig
    field = None
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = section_model(field.annotation)
    return field


def closest_keys(dotted: str, n: int = 3, objective: str | None = None) -> list[str]:
    """The valid keys nearest `dotted`: first the key its last part goes by elsewhere (TRL's `num_generations` is
    `rollout.n`, `rl_core.config.aliases`), then the nearest spellings."""
    keys = all_keys() + [f"data.rewards[i].{name}" for name in RewardEntry.model_fields]
    dotted = re.sub(r"\[\d+\]", "[i]", dotted)  # an entry of data.rewards: any index
    close = difflib.get_close_matches(dotted, keys, n=n, cutoff=0.5)
    if not close:  # fall back to the last component (e.g. `rl.lr` -> `rl.optimizer.lr`)
        leaf = dotted.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:n]
        if not close:
            leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
            close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=n, cutoff=0.6)]
    alias = alias_key(dotted.rsplit(".", 1)[-1], objective)
    if alias in keys and alias != dotted:
        close = [alias, *(k for k in close if k != alias)][:n]
    return close


def unknown_key_message(dotted: str, value: Any, objective: str | None = None, shown: str | None = None) -> str:
    """The refusal of a key the schema does not have, with what it is now called or the closest keys (`shown`: the
    value as the message quotes it)."""
    if dotted in MOVED_KEYS:
        return moved_key_message(dotted, value)
    if dotted in FOLDED_KEYS:
        return folded_key_message(dotted, value)
    if dotted in RETIRED_KEYS:
        table = RETIRED_KEYS[dotted]
        repl = table.get(str(value) if value is not None else None) or table[None]
        return f"{dotted}={value!s}: retired key; use {repl} instead (retired keys are not aliased)"
    given = f"{dotted}={shown}" if shown is not None else dotted
    if hint := alias_hint(dotted.rsplit(".", 1)[-1], value, objective):
        return f"{given}: unknown key; {hint}"
    close = closest_keys(dotted, objective=objective)
    hint = f"; closest valid keys: {', '.join(close)}" if close else ""
    return f"{given}: unknown key{hint}"


# ----------------------------------------------------------------------------------- validation


def _dotted(loc: Iterable[Any]) -> str:
    """`("data", "rewards", 0, "path")` -> `data.rewards[0].path`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def describe_error(err: dict, objective: str | None = None) -> str:
    """One pydantic error as a line naming the dotted key and the value (`objective`: the config's rl.objective.type,
    for the hints that depend on it)."""
    parts = list(err["loc"])
    if parts[:2] == ["rl", "objective"] and len(parts) > 2 and parts[2] in OBJECTIVES:
        objective = parts.pop(2)  # the union's tag: the key is rl.objective.<field> whatever the type
    loc = _dotted(parts)
    value = err.get("input")
    kind = err["type"]
    ctx = err.get("ctx", {}) or {}
    # never echo credentials embedded in a URI; a function by its name, not its address
    shown = f"<{'class' if isinstance(value, type) else 'function'} {value.__qualname__}>" \
        if callable(value) and hasattr(value, "__qualname__") else redact_uri(repr(value))
    if kind == "extra_forbidden" and loc.startswith(OBJECTIVE_KEY + ".") and loc not in MOVED_KEYS:
        knob = loc.rsplit(".", 1)[-1]
        owners = [t for t, c in OBJECTIVES.items() if knob in c.model_fields]
        if not owners:
            return unknown_key_message(loc, value, objective, shown)
        own = alias_key(knob, objective)
        if objective in OBJECTIVES and own and own != loc and own.startswith(OBJECTIVE_KEY + ".") \
                and own.rsplit(".", 1)[-1] in OBJECTIVES[objective].model_fields:  # the knob under this objective's name
            said = f"TRL's {knob}: " if ALIASES[knob].trl else ""
            return (f"{loc}={shown}: not a knob of {objective} (read by rl.objective.type={'|'.join(owners)}); "
                    f"{objective}'s is {own} ({said}{ALIASES[knob].note})")
        return (f"{loc}={shown}: not a knob of {objective or 'this objective'} "
                f"(read by rl.objective.type={'|'.join(owners)}); remove it")
    if kind == "extra_forbidden":
        return unknown_key_message(loc, value, objective, shown)
    if isinstance(value, bool) and kind in ("int_type", "float_type"):
        return f"{loc}={shown}: a bool is not a number; write a numeric value"
    if kind == "int_type" and isinstance(value, float):
        if math.isfinite(value) and value != int(value):
            return f"{loc}={shown}: fractional value for an integer field"
        return f"{loc}={shown}: expected an integer"
    if loc == OBJECTIVE_KEY and isinstance(value, str):  # a name where the section goes
        return unknown_key_message(loc, value).replace(": retired key;", ": retired value;")
    if kind == "value_error" and loc == OBJECTIVE_KEY:  # an objective's own rule: its message starts "<knob>=..."
        return f"{loc}.{err['msg'].removeprefix('Value error, ')}"
    if kind == "finite_number":
        return f"{loc}={shown}: NaN and infinity are not allowed"
    if kind == "literal_error":
        hint = ENUM_HINTS.get((loc, str(value)))
        allowed = ctx.get("expected", "")
        msg = f"{loc}={shown}: not one of {allowed}"
        return f"{msg}; {hint}" if hint else msg
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()), "")
        return f"{loc}={shown}: must be {op} {bound}"
    alias = ALIASES.get(loc.rsplit(".", 1)[-1])
    if alias and alias.key == loc and str(value).lower() in alias.values:  # a TRL value of this key: loss_type=dapo
        return f"{loc}={shown}: {err['msg']}; {alias_hint(loc.rsplit('.', 1)[-1], value)}"
    return f"{loc}={shown}: {err['msg']}"

