"""Configs written before objectives owned `rl.objective` (`job.algorithm` plus flat `rl.*` knobs).

The fixtures under tests/fixtures/flat_configs/ are `config_resolved.yaml` files and objective identities in the
flat shape, written by posttrain 2fd5671 for one recipe per objective: each loads through the one
translation (rl_core/config/legacy.py) to the config the current recipe builds, with the identical objective identity
(so a checkpoint's objective hash still matches) and no math change for resume. A recipe or an override that names
an old key is refused, naming the new one.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from infra.checkpoints.resume import math_changes
from rl_core.algorithms.context import ObjectiveContext
from rl_core.algorithms.registry import build_objective
from rl_core.config import ConfigError, config_from_dict, load_config
from rl_core.config.legacy import LegacyConfigWarning

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "flat_configs"
CUSTOM = "rl.objective={type: custom, import_path: 'examples.custom_objective:build_objective'}"
# a saved config names the experiment it went to (then the default, written out); a recipe now leaves it to
# $MLFLOW_EXPERIMENT_NAME or "posttrain"
SAVED_EXPERIMENT = "tracking.experiment=posttrain"
# fixture -> the current recipe and overrides that build the same run
NOW = {
    "arithmetic": ("recipes/arithmetic.py", []),
    "gspo_gsm8k": ("recipes/gspo_gsm8k.py", []),
    "dr_grpo_gsm8k": ("recipes/dr_grpo_gsm8k.py", []),
    "opd_gsm8k": ("recipes/opd_gsm8k.py", []),
    "dpo_arithmetic": ("recipes/dpo_arithmetic.py", ["rl.objective.beta=0.25"]),
    "grpo_kl": ("recipes/grpo_gsm8k.py", ["rl.objective.kl_beta=0.05", "rl.objective.kl_estimator=k2"]),
    "custom": ("recipes/arithmetic.py", [CUSTOM]),
}


def flat(name: str) -> dict:
    return yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", sorted(NOW))
def test_a_saved_flat_config_loads_to_the_same_run_and_objective(name):
    saved = flat(name)
    assert "algorithm" in saved["job"] and "objective" not in saved["rl"]  # the old shape, as written then
    with pytest.warns(LegacyConfigWarning, match="rl.objective"):
        old = config_from_dict(saved)
    recipe, overrides = NOW[name]
    now = load_config(recipe, [*overrides, SAVED_EXPERIMENT])
    assert old.model_dump() == now.model_dump()
    assert old.rl.objective.type == saved["job"]["algorithm"] or (name == "custom" and old.rl.objective.type == "custom")
    identity = build_objective(old, ObjectiveContext.from_config(old)).identity
    assert identity == json.loads((FIXTURES / f"{name}.identity.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyConfigWarning)
        assert math_changes(saved, now) == []  # a run of the old shape resumes under the new one
        assert math_changes(saved, load_config(recipe, [*overrides, "rollout.temperature=0.5"])) == \
            ["rollout.temperature"]


def test_a_saved_flat_config_with_a_knob_its_objective_never_reads_is_refused_naming_the_new_key():
    saved = flat("dpo_arithmetic")
    saved["rl"]["epsilon_high"] = 0.28
    with pytest.warns(LegacyConfigWarning), pytest.raises(ConfigError) as info:
        config_from_dict(saved)
    (problem,) = info.value.problems
    assert problem.startswith("rl.objective.epsilon_high=0.28: not a knob of dpo")


@pytest.mark.parametrize("line, new", [
    ('cfg.job.algorithm = "gspo"', "use rl.objective.type (e.g. rl.objective.type=gspo)"),
    ("cfg.rl.opd_kl_coef = 2.0", "use rl.objective.kl_coef"),
    ('cfg.rl.grpo_surrogate = "legacy_pg"', "the legacy policy gradient is rl.objective.type=legacy_pg"),
])
def test_a_recipe_that_sets_an_old_key_is_refused_naming_the_new_one(tmp_path, line, new):
    recipe = tmp_path / "old_recipe.py"
    recipe.write_text(f"from rl_core.config import PosttrainConfig\n\n\ndef build_config():\n    cfg = PosttrainConfig()\n"
                      f"    {line}\n    return cfg\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe)
    (problem,) = info.value.problems
    assert "a knob of the objective's own section" in problem and new in problem


@pytest.mark.parametrize("override, new", [
    ("job.algorithm=dpo", "rl.objective.type=dpo"),
    ("rl.dpo_beta=0.5", "use rl.objective.beta"),
    ("rl.custom_objective=examples.custom_objective:build_objective", "use rl.objective.import_path with rl.objective.type=custom"),
])
def test_an_old_override_is_refused_naming_the_new_key(override, new):
    with pytest.raises(ConfigError) as info:
        load_config("recipes/arithmetic.py", [override])
    (problem,) = info.value.problems
    assert problem.startswith(override.split("=")[0]) and new in problem


# ------------------------------------------------------------------ rl.temperature, folded into rollout.temperature


def saved_with_trainer_temperature(recipe: str, overrides: list[str], rl_temperature: float) -> dict:
    """A config_resolved.yaml as written while the trainer had its own key, `rl.temperature`."""
    from rl_core.config.loader import config_dict

    saved = config_dict(load_config(recipe, overrides))
    saved["rl"] = {**saved["rl"], "temperature": rl_temperature}
    return saved


@pytest.mark.parametrize("recipe, overrides", [("recipes/gspo_gsm8k.py", ["rollout.temperature=0.8"]),
                                               ("recipes/opd_gsm8k.py", []), ("recipes/arithmetic.py", [])])
def test_a_saved_rl_temperature_equal_to_the_rollouts_loads_to_the_same_run_and_identity(recipe, overrides):
    now = load_config(recipe, overrides)
    saved = saved_with_trainer_temperature(recipe, overrides, now.rollout.temperature)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the value is the rollout's
        old = config_from_dict(saved)
    assert old.model_dump() == now.model_dump()
    assert build_objective(old, ObjectiveContext.from_config(old)).identity == \
        build_objective(now, ObjectiveContext.from_config(now)).identity
    assert build_objective(old, ObjectiveContext.from_config(old)).identity["temperature"] == now.rollout.temperature
    assert math_changes(saved, now) == []  # such a run resumes


def test_a_saved_dpo_rl_temperature_becomes_the_one_temperature_of_its_log_probs():
    """DPO samples nothing: its rl.temperature was the only temperature it read, so it moves to rollout.temperature
    and the objective identity (hashed into its checkpoints) keeps it."""
    saved = saved_with_trainer_temperature("recipes/dpo_arithmetic.py", [], 0.9)
    assert saved["rollout"]["temperature"] == 1.0
    with pytest.warns(LegacyConfigWarning, match="rl.temperature=0.9"):
        old = config_from_dict(saved)
    assert old.rollout.temperature == 0.9
    assert build_objective(old, ObjectiveContext.from_config(old)).identity["temperature"] == 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyConfigWarning)
        assert math_changes(saved, old) == []


def test_a_saved_on_policy_config_that_sampled_and_trained_at_two_temperatures_is_refused():
    saved = saved_with_trainer_temperature("recipes/gspo_gsm8k.py", [], 0.7)
    with pytest.raises(ConfigError) as info:
        config_from_dict(saved)
    (problem,) = info.value.problems
    assert problem.startswith("rl.temperature=0.7: retired") and "rollout.temperature" in problem
