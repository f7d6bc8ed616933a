"""Recipes, dotlist overrides, error reporting and the config identity (docs/config.md).

`load_config(recipe_path, overrides)` is the one way a config is built from a recipe: the CLI, the flows
and deployments call it, and the same recipe path and dotlist always rebuild the identical config. Ray actors do not re-run a recipe:
they receive the resolved config as data (`config_from_dict`, see `infra.policy_worker.worker_config`).
Every problem is collected and reported together in one `ConfigError`, each line naming the full
dotted key and the offending value, before any model or cluster exists.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rl_core.config.aliases import ALIASES, alias_hint, alias_key
from rl_core.config.legacy import FOLDED_KEYS, MOVED_KEYS, folded_key_message, moved_key_message, translate
from rl_core.config.schema import PosttrainConfig, RewardEntry
from rl_core.redact import redact_text, redact_uri
from rl_core.registry import OBJECTIVES
from rl_core.user_code import RECIPE_MODULE_PREFIX

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


def _field_for(dotted: str) -> Any | None:
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


def _unknown_key_message(dotted: str, value: Any, objective: str | None = None, shown: str | None = None) -> str:
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


# -------------------------------------------------------------------------------------- dotlist


def _accepts(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(annotation))
    return False


def parse_value(dotted: str, raw: str) -> Any:
    """Parse a dotlist value with the field's type in mind (still validated strictly afterwards)."""
    field = _field_for(dotted)
    text = raw.strip()
    if field is not None:
        ann = field.annotation
        if text.lower() in ("null", "none", "~") and _accepts(ann, type(None)):
            return None
        if _accepts(ann, str) or typing.get_origin(ann) is typing.Literal:
            return raw
        if _accepts(ann, float) and text.lower() in ("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity"):
            return float(text)
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return raw
    # YAML reads 1e-6 as a string (no dot); numbers written that way are numbers on a command line.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else int(value)
        except ValueError:
            return value
    return value


def parse_dotlist(overrides: Iterable[str]) -> list[tuple[str, Any, str]]:
    """`["rl.max_steps=1", ...]` -> `[(key, parsed value, raw text), ...]`."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"{item!r}: an override must be key=value, e.g. rl.max_steps=1"])
        key, raw = item.split("=", 1)
        key = key.strip()
        parsed.append((key, parse_value(key, raw), raw))
    return parsed


# ----------------------------------------------------------------------------------- validation


def _dotted(loc: Iterable[Any]) -> str:
    """`("data", "rewards", 0, "path")` -> `data.rewards[0].path`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _describe(err: dict, objective: str | None = None) -> str:
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
            return _unknown_key_message(loc, value, objective, shown)
        own = alias_key(knob, objective)
        if objective in OBJECTIVES and own and own != loc and own.startswith(OBJECTIVE_KEY + ".") \
                and own.rsplit(".", 1)[-1] in OBJECTIVES[objective].model_fields:  # the knob under this objective's name
            said = f"TRL's {knob}: " if ALIASES[knob].trl else ""
            return (f"{loc}={shown}: not a knob of {objective} (read by rl.objective.type={'|'.join(owners)}); "
                    f"{objective}'s is {own} ({said}{ALIASES[knob].note})")
        return (f"{loc}={shown}: not a knob of {objective or 'this objective'} "
                f"(read by rl.objective.type={'|'.join(owners)}); remove it")
    if kind == "extra_forbidden":
        return _unknown_key_message(loc, value, objective, shown)
    if isinstance(value, bool) and kind in ("int_type", "float_type"):
        return f"{loc}={shown}: a bool is not a number; write a numeric value"
    if kind == "int_type" and isinstance(value, float):
        if math.isfinite(value) and value != int(value):
            return f"{loc}={shown}: fractional value for an integer field"
        return f"{loc}={shown}: expected an integer"
    if loc == OBJECTIVE_KEY and isinstance(value, str):  # a name where the section goes
        return _unknown_key_message(loc, value).replace(": retired key;", ": retired value;")
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


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set `a.b.c` in a nested dict (a key the schema knows), adding the sections the dict leaves out (their
    other keys then take the schema's defaults); a parent holding a value rather than a section is replaced."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def config_from_dict(data: dict, overrides: Iterable[str] = (), source: str | None = None) -> PosttrainConfig:
    """Validate a plain dict (e.g. a parsed config_resolved.yaml) plus overrides, strictly."""
    data = translate(json.loads(json.dumps(data)))  # deep copy, plain types only, in the current shape
    problems: list[str] = []
    parsed = parse_dotlist(overrides)
    objective = _objective_type(data, parsed)
    for key, value, raw in parsed:
        if (key in RETIRED_KEYS and key != OBJECTIVE_KEY) or key in MOVED_KEYS or _field_for(key) is None:
            problems.append(_unknown_key_message(key, raw, objective))
            continue
        if section_model(_field_for(key).annotation) is not None:
            problems.append(f"{key}: is a section; set one of its keys, e.g. {all_keys(section_model(_field_for(key).annotation), key + '.')[0]}")
            continue
        if key == OBJECTIVE_KEY + ".type":
            _switch_objective(data, value)
        _set_dotted(data, key, value)
    try:
        cfg = PosttrainConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(_describe(e, objective) for e in exc.errors())
        raise ConfigError(problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _objective_type(data: dict, overrides: list[tuple[str, Any, str]]) -> str | None:
    """The rl.objective.type the config will have: the last override that sets it, else the dict's (grpo when the
    dict leaves the objective out)."""
    for key, value, _ in reversed(overrides):
        if key == OBJECTIVE_KEY + ".type" or (key == OBJECTIVE_KEY and isinstance(value, dict)):
            return str(value.get("type") if isinstance(value, dict) else value)
    rl = data.get("rl") if isinstance(data.get("rl"), dict) else {}
    section = rl.get("objective", {})
    return section.get("type") if isinstance(section, dict) else None


def _switch_objective(data: dict, kind: Any) -> None:
    """`rl.objective.type=<other>` on a config whose objective is of another type: keep the knobs the recipe set
    (values other than their type's default) that the new type also has; the rest take the new type's defaults."""
    rl = data.get("rl")
    old = rl.get("objective") if isinstance(rl, dict) else None
    if not isinstance(old, dict) or old.get("type") == kind or kind not in OBJECTIVES:
        return
    before = OBJECTIVES.get(old.get("type"))
    after = OBJECTIVES[kind].model_fields
    rl["objective"] = {k: v for k, v in old.items() if k in after and k != "type" and before is not None
                       and k in before.model_fields and v != before.model_fields[k].default}


def _section_paths() -> dict[str, tuple[str, ...]]:
    """Each class of the config (by name: the title of a ValidationError it raises) -> where it sits in the tree."""
    paths: dict[str, tuple[str, ...]] = {PosttrainConfig.__name__: ()}

    def walk(model: type[BaseModel], prefix: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            if (sub := section_model(field.annotation)) is not None:
                paths[sub.__name__] = (*prefix, name)
                walk(sub, (*prefix, name))

    walk(PosttrainConfig, ())
    paths.update({cls.__name__: (*OBJECTIVE_KEY.split("."), kind) for kind, cls in OBJECTIVES.items()})
    paths[RewardEntry.__name__] = ("data", "rewards[i]")
    return paths


def _recipe_call(path: Path, fn: Callable[[], Any]) -> Any:
    """`fn()` of a recipe file (running it, its build_config); a mistake in it on the config (`cfg.model.lora.rank = 8`,
    a value of the wrong type, a reward function without an import path) is a ConfigError like an override's: the
    dotted key, the value, the closest keys or what to do. A ValidationError of a model outside the config propagates."""
    try:
        return fn()
    except ValidationError as exc:
        prefix = _section_paths().get(exc.title)
        if prefix is None:
            raise
        problems = []
        for err in exc.errors():
            kind = "extra_forbidden" if err["type"] == "no_such_attribute" else err["type"]  # assignment to a typo
            problems.append(_describe({**err, "type": kind, "loc": (*prefix, *err["loc"])}))
    raise ConfigError(problems, str(path))  # outside the except block: no pydantic traceback attached


def load_recipe_module(recipe_path: str | os.PathLike):
    path = Path(recipe_path)
    if not path.is_file():
        raise ConfigError([f"recipe {str(path)!r}: no such file; recipes live in recipes/*.py"])
    name = f"{RECIPE_MODULE_PREFIX}{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    _recipe_call(path, lambda: spec.loader.exec_module(module))
    if not hasattr(module, "build_config"):
        raise ConfigError([f"recipe {str(path)!r}: defines no build_config()"])
    return module


def load_config(recipe_path: str | os.PathLike, overrides: Iterable[str] = ()) -> PosttrainConfig:
    """Build the typed config of a recipe file, then apply a dotlist of overrides.

    A recipe may also be a resolved YAML (`config_resolved.yaml`), which round-trips exactly.
    """
    path = Path(recipe_path)
    overrides = list(overrides)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError([f"config {str(path)!r}: no such file"])
        return config_from_dict(yaml.safe_load(path.read_text()) or {}, overrides, str(path))
    module = load_recipe_module(path)
    base = _recipe_call(path, module.build_config)
    if not isinstance(base, PosttrainConfig):
        raise ConfigError([f"recipe {str(path)!r}: build_config() returned {type(base).__name__}, not PosttrainConfig"])
    # entries appended to data.rewards in place were not validated: assigning the list validates them (a function
    # object becomes its import path)
    _recipe_call(path, lambda: setattr(base.data, "rewards", list(base.data.rewards)))
    # Re-validate the recipe's own values too: assignment inside a recipe is validated, but a
    # recipe could construct sections with model_construct.
    return config_from_dict(base.model_dump(mode="json"), overrides, str(path))


# ------------------------------------------------------------------------------ identity and I/O


def config_dict(cfg: PosttrainConfig) -> dict:
    return cfg.model_dump(mode="json")


def config_hash(cfg: PosttrainConfig) -> str:
    """Stable identity of a resolved config: sha256 of its canonical JSON (first 16 hex digits)."""
    canonical = json.dumps(config_dict(cfg), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def to_yaml(cfg: PosttrainConfig) -> str:
    return yaml.safe_dump(config_dict(cfg), sort_keys=False, default_flow_style=False)


def write_resolved(cfg: PosttrainConfig, run_dir: str | os.PathLike | None = None) -> Path:
    """Write `config_resolved.yaml` into the run directory (atomically) and return its path."""
    out = Path(run_dir or cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "config_resolved.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, target)
    return target


def flatten(cfg: PosttrainConfig) -> dict[str, Any]:
    """`{"rl.optimizer.lr": 1e-6, ...}`: every leaf under its dotted key."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(config_dict(cfg), "")
    return out
