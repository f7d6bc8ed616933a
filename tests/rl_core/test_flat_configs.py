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

from infra.resume import math_changes
from rl_core.algorithms.context import ObjectiveContext
from rl_core.config import ConfigError, config_from_dict, load_config
from rl_core.config.legacy import LegacyConfigWarning
from rl_core.registry import build_objective

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
        assert math_changes(saved, load_config(recipe, [*overrides, "rl.temperature=0.5"])) == ["rl.temperature"]


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
