"""Recipes and dotlist overrides into a config, and the config identity (docs/config.md).

`load_config(recipe_path, overrides)` is the one way a config is built from a recipe: the CLI, the flows
and deployments call it, and the same recipe path and dotlist always rebuild the identical config. Ray actors do not re-run a recipe:
they receive the resolved config as data (`config_from_dict`, see `infra.workers.actor.worker_config`).
Every problem is collected and reported together in one `ConfigError`, each line naming the full
dotted key and the offending value, before any model or cluster exists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
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

from rl_core.algorithms.registry import OBJECTIVES
from rl_core.config.explain import (
    OBJECTIVE_KEY,
    RETIRED_KEYS,
    ConfigError,
    all_keys,
    describe_error,
    field_for,
    section_model,
    unknown_key_message,
)
from rl_core.config.legacy import MOVED_KEYS, translate
from rl_core.config.schema import PosttrainConfig, RewardEntry
from rl_core.user_code import RECIPE_MODULE_PREFIX

# -------------------------------------------------------------------------------------- dotlist


def _accepts(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(annotation))
    return False


class _OverrideLoader(yaml.SafeLoader):
    """YAML's safe loader, reading an unquoted 1e-4 (no dot, which YAML 1.1 takes for text) as the number it is on a
    command line, inside a flow-syntax section too (`"rl.objective={type: ppo, critic_lr: 1e-4}"`); quoted, it
    stays text."""


_OverrideLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                      re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                      list("-+0123456789"))


def parse_value(dotted: str, raw: str) -> Any:
    """Parse a dotlist value with the field's type in mind (still validated strictly afterwards)."""
    field = field_for(dotted)
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
        value = yaml.load(text, Loader=_OverrideLoader) if text else ""  # a SafeLoader: no object is built
    except yaml.YAMLError:
        return raw
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


# ----------------------------------------------------------------------------------- building


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
        if (key in RETIRED_KEYS and key != OBJECTIVE_KEY) or key in MOVED_KEYS or field_for(key) is None:
            problems.append(unknown_key_message(key, raw, objective))
            continue
        if section_model(field_for(key).annotation) is not None:
            problems.append(f"{key}: is a section; set one of its keys, e.g. {all_keys(section_model(field_for(key).annotation), key + '.')[0]}")
            continue
        if key == OBJECTIVE_KEY + ".type":
            _switch_objective(data, value)
        _set_dotted(data, key, value)
    try:
        cfg = PosttrainConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(describe_error(e, objective) for e in exc.errors())
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
            problems.append(describe_error({**err, "type": kind, "loc": (*prefix, *err["loc"])}))
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
