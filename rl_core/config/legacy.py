"""The one translation of configs written before objectives owned their section.

Those configs name the algorithm in `job.algorithm` and keep every objective knob flat in `rl`
(`rl.grpo_surrogate`, `rl.epsilon_low`, `rl.opd_kl_coef`, `rl.dpo_beta`, `rl.custom_objective`, ...).
A saved config of that shape (a run's `config_resolved.yaml`, a checkpoint's config) loads through
`translate`, which moves each knob into `rl.objective` under its new name; the result is the same
run, with the same objective identity. A recipe or an override that still names an old key is
refused with the new key (`moved_key_message`): code and command lines are fixed once, by hand.

`rl.temperature`, the trainer's log-prob temperature, had to equal `rollout.temperature` by hand; the one key is
now `rollout.temperature`. A saved config's `rl.temperature` is dropped when it equals `rollout.temperature`, and
becomes `rollout.temperature` for an objective that samples nothing (DPO, a custom offline one), whose only
temperature it was; the objective identity is unchanged either way. Anywhere else it is refused, naming
`rollout.temperature` (`folded_key_message`).
"""

from __future__ import annotations

import warnings
from typing import Any

# old rl.<key> -> its key inside rl.objective
RL_KEYS = {
    "grpo_surrogate": "surrogate", "importance_sampling_level": "importance_sampling_level",
    "epsilon_low": "epsilon_low", "epsilon_high": "epsilon_high", "lower_bound_ratio": "lower_bound_ratio",
    "loss_type": "loss_type", "unbiased_advantage": "unbiased_advantage", "advantage_eps": "advantage_eps",
    "kl_beta": "kl_beta", "kl_estimator": "kl_estimator", "shared_prefix_min_tokens": "shared_prefix_min_tokens",
    "certified_deterministic_forward": "certified_deterministic_forward",
    "certified_forward_atol": "certified_forward_atol", "distillation_mode": "distillation_mode",
    "opd_kl_coef": "kl_coef", "opd_discount": "discount", "opd_task_reward_weight": "task_reward_weight",
    "dpo_beta": "beta", "custom_objective": "import_path",
}
# their defaults when they were flat: a knob an objective does not read was left at it, so it is dropped
OLD_DEFAULTS = {
    "grpo_surrogate": "clipped", "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2,
    "lower_bound_ratio": 3.0, "loss_type": "token-mean", "unbiased_advantage": False, "advantage_eps": 1e-6,
    "kl_beta": 0.0, "kl_estimator": "k3", "shared_prefix_min_tokens": 0, "certified_deterministic_forward": False,
    "certified_forward_atol": 1e-5, "distillation_mode": "advantage", "opd_kl_coef": 1.0, "opd_discount": 0.0,
    "opd_task_reward_weight": 0.0, "dpo_beta": 0.1, "custom_objective": None,
}
FIXED_BY_ALGORITHM = ("grpo_surrogate", "importance_sampling_level")  # what job.algorithm pinned
MOVED_KEYS = {"job.algorithm": "rl.objective.type", **{f"rl.{old}": f"rl.objective.{new}" for old, new in RL_KEYS.items()}}
# keys whose value another key now owns: old key -> its owner
FOLDED_KEYS = {"rl.temperature": "rollout.temperature"}


class LegacyConfigWarning(UserWarning):
    """A config of the flat shape was translated; write it in the new shape."""


def moved_key_message(dotted: str, value: Any) -> str:
    """The refusal of an old key in a recipe or an override, naming its new key."""
    new = MOVED_KEYS[dotted]
    hint = ""
    if dotted == "job.algorithm":
        hint = f" (e.g. rl.objective.type={value})"
    elif dotted == "rl.grpo_surrogate" and value == "legacy_pg":
        hint = " (the legacy policy gradient is rl.objective.type=legacy_pg)"
    elif dotted == "rl.custom_objective":
        hint = " with rl.objective.type=custom"
    return (f"{dotted}={value}: a knob of the objective's own section; use {new}{hint}; see docs/objectives.md "
            "('Configs written before rl.objective')")


def folded_key_message(dotted: str, value: Any) -> str:
    """The refusal of `rl.temperature` in a recipe, an override or a saved config where it cannot be folded."""
    owner = FOLDED_KEYS[dotted]
    return (f"{dotted}={value}: retired; {owner} is the one temperature, of sampling and of the trainer's "
            f"log-probs (the importance ratio compares the two); set {owner}={value} instead")


def _samples_nothing(objective: Any) -> bool:
    """The objective section (a dict) names an offline objective: DPO, or a custom one with step_loop=offline."""
    from rl_core.algorithms.registry import OBJECTIVES

    if not isinstance(objective, dict) or objective.get("type") not in OBJECTIVES:
        return False
    if objective["type"] == "custom":
        return objective.get("step_loop") == "offline"
    return OBJECTIVES[objective["type"]].TOPOLOGY == "offline"


def fold_temperature(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config's `rl.temperature` folded into `rollout.temperature` (see the module's docstring)."""
    rl, rollout = data.get("rl"), data.get("rollout")
    if not isinstance(rl, dict) or "temperature" not in rl or not isinstance(rollout, dict) \
            or "temperature" not in rollout:
        return data  # not there, or nothing to compare it with: a set rl.temperature is refused by validation
    value = rl["temperature"]
    if value != rollout["temperature"]:
        if not _samples_nothing(rl.get("objective")):
            return data  # sampled and trained at two temperatures: refused, naming rollout.temperature
        warnings.warn(f"rl.temperature={value} (saved) is now rollout.temperature, the one temperature of "
                      f"rl.objective.type={rl['objective']['type']}'s log-probs", LegacyConfigWarning, stacklevel=3)
        rollout = {**rollout, "temperature": value}
    return {**data, "rl": {k: v for k, v in rl.items() if k != "temperature"}, "rollout": rollout}


def _infer_type(flat: dict[str, Any]) -> str:
    if flat.get("custom_objective"):
        return "custom"
    if any(k in flat for k in ("distillation_mode", "opd_kl_coef", "opd_discount", "opd_task_reward_weight")):
        return "opd"
    if "dpo_beta" in flat:
        return "dpo"
    if flat.get("grpo_surrogate") == "legacy_pg":
        return "legacy_pg"
    return "gspo" if flat.get("importance_sampling_level") == "sequence" else "grpo"


def translate_rl(rl: dict[str, Any], algorithm: str | None = None) -> dict[str, Any]:
    """An `rl` section of the flat shape (plus the old `job.algorithm`) in the new shape; others unchanged."""
    flat = {k: rl[k] for k in RL_KEYS if k in rl}
    if not flat and algorithm is None:
        return rl
    from rl_core.algorithms.registry import OBJECTIVES

    out = {k: v for k, v in rl.items() if k not in RL_KEYS}
    if out.get("objective") is not None and not isinstance(out["objective"], dict):
        return rl  # an older name in place of the section: refused by validation, naming its replacement
    objective = dict(out.get("objective") or {})
    kind = objective.get("type") or ("custom" if flat.get("custom_objective") else algorithm) or _infer_type(flat)
    objective["type"] = kind
    if kind == "custom":
        old = OBJECTIVES.get(algorithm or "grpo")
        if old is not None:
            objective.setdefault("step_loop", old.TOPOLOGY)
            objective.setdefault("group_advantages", old.GROUP_RELATIVE)
    fields = OBJECTIVES[kind].model_fields if kind in OBJECTIVES else {}
    for old_key, value in flat.items():
        new_key = RL_KEYS[old_key]
        if new_key in objective:
            continue  # written in the new shape too: that one wins
        if kind == "custom" and old_key in FIXED_BY_ALGORITHM:
            continue  # the old algorithm's label (it picked the step loop), not a knob of your builder
        if new_key in fields or value != OLD_DEFAULTS[old_key]:
            objective[new_key] = value  # a value this objective never read stays, and is refused naming its key
    out["objective"] = objective
    warnings.warn(f"a config of the flat shape was translated (rl.objective.type={kind}): "
                  f"{', '.join(sorted(f'rl.{k}' for k in flat) + (['job.algorithm'] if algorithm else []))} now live "
                  "in rl.objective (docs/objectives.md)", LegacyConfigWarning, stacklevel=3)
    return out


def translate(data: dict[str, Any]) -> dict[str, Any]:
    """A whole config dict (a saved `config_resolved.yaml` or checkpoint config) in the new shape."""
    job = data.get("job")
    rl = data.get("rl")
    algorithm = job.get("algorithm") if isinstance(job, dict) else None
    if not isinstance(rl, dict) and algorithm is None:
        return data
    out = dict(data)
    if isinstance(job, dict) and "algorithm" in job:
        out["job"] = {k: v for k, v in job.items() if k != "algorithm"}
    out["rl"] = translate_rl(dict(rl) if isinstance(rl, dict) else {}, algorithm)
    return fold_temperature(out)
