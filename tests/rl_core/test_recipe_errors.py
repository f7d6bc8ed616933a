"""Mistakes inside a recipe file (docs/config.md): reported as a ConfigError like an override's, naming the dotted key,
the value and the closest keys; reward functions given as function objects in `data.rewards` recorded by their import
path, or refused saying how to make them importable."""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest

from rl_core.config import ConfigError, load_config, to_yaml
from rl_core.config.loader import config_dict
from rl_core.preflight.rules import preflight
from rl_core.user_code import ImportPathError, import_path_of

HEAD = "from rl_core.config import PosttrainConfig\n"


def recipe(tmp_path, body: str, head: str = HEAD):
    """A recipe file whose build_config() runs `body` on `cfg`."""
    path = tmp_path / f"recipe_{uuid.uuid4().hex[:8]}.py"
    path.write_text(head + "\n\ndef build_config():\n    cfg = PosttrainConfig()\n"
                    + textwrap.indent(textwrap.dedent(body), "    ") + "    return cfg\n")
    return path


def problems_of(path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.__context__ is None or info.value.__suppress_context__  # no pydantic traceback attached
    return info.value.problems


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    """An importable module of TRL-style rewards (as my_rewards.py beside where posttrain runs would be)."""
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def accuracy_reward(completions, solution, **kwargs):
            return [float(c[-1]["content"] == s) for c, s in zip(completions, solution)]


        def format_reward(completions, **kwargs):
            return [1.0 for _ in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# ------------------------------------------------------------------------------------ wrong keys


def test_a_wrong_attribute_names_the_dotted_key_the_value_and_the_closest_keys(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.model.lora.rank = 8\n"))
    assert msg == "model.lora.rank=8: unknown key; closest valid keys: model.lora.r, model.lora.alpha, " \
                  "model.lora.dropout"


def test_a_wrong_value_names_the_dotted_key_and_the_value(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.rollout.n = '8'\n"))
    assert msg.startswith("rollout.n='8': ")
    (msg,) = problems_of(recipe(tmp_path, "cfg.tracking.s3.max_attempts = 0\n"))
    assert msg == "tracking.s3.max_attempts=0: must be >= 1"


def test_a_section_built_with_a_typo_names_the_key_inside_it(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.model.lora = {'rank': 8}\n"))
    assert msg.startswith("model.lora.rank=8: unknown key; closest valid keys: model.lora.r")
    (msg,) = problems_of(recipe(tmp_path, "cfg.rl.optimizer = OptimizerConfig(learning_rate=1e-5)\n",
                                HEAD + "from rl_core.config import OptimizerConfig\n"))
    assert msg == "rl.optimizer.learning_rate=1e-05: unknown key; TRL's learning_rate is rl.optimizer.lr here"


def test_a_trl_name_in_a_recipe_names_its_key(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.rl.beta = 0.04\n"))
    assert msg.startswith("rl.beta=0.04: unknown key; TRL's beta is rl.objective.kl_beta here")
    (msg,) = problems_of(recipe(tmp_path, "cfg.rollout.num_generations = 4\n"))
    assert msg.startswith("rollout.num_generations=4: unknown key; TRL's num_generations is rollout.n here")


def test_another_objectives_knob_in_a_recipe_names_the_chosen_objectives_own(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.rl.objective.beta = 0.04\n"))
    assert msg.startswith("rl.objective.beta=0.04: not a knob of grpo (read by rl.objective.type=dpo); "
                          "grpo's is rl.objective.kl_beta")
    (msg,) = problems_of(recipe(tmp_path, "cfg.rl.objective = GSPO(lower_bound_ratio=2.0)\n",
                                HEAD + "from rl_core.algorithms.grpo import GSPO\n"))
    assert msg.startswith("rl.objective.lower_bound_ratio=2.0: no dual clip")


def test_an_old_key_in_a_recipe_still_names_its_new_key(tmp_path):
    (msg,) = problems_of(recipe(tmp_path, "cfg.rl.temperature = 0.7\n"))
    assert msg.startswith("rl.temperature=0.7: retired; rollout.temperature is the one temperature")


def test_a_mistake_at_a_recipes_top_level_is_reported_too(tmp_path):
    path = tmp_path / "top_level.py"
    path.write_text(HEAD + "BASE = PosttrainConfig()\nBASE.rollout.max_token = 8\n\n\n"
                           "def build_config():\n    return BASE\n")
    (msg,) = problems_of(path)
    assert msg.startswith("rollout.max_token=8: unknown key; closest valid keys: rollout.max_tokens")


def test_a_validation_error_of_another_model_is_not_taken_for_the_configs(tmp_path):
    head = HEAD + "from pydantic import BaseModel\n\n\nclass Mine(BaseModel):\n    x: int\n"
    with pytest.raises(ValueError) as info:
        load_config(recipe(tmp_path, "Mine(x='no')\n", head))
    assert not isinstance(info.value, ConfigError) and "Mine" in str(info.value)


# ------------------------------------------------------------------------------ reward functions


def test_importable_reward_functions_are_recorded_by_their_import_path(tmp_path, rewards_module):
    path = recipe(tmp_path, "cfg.data.task = 'prompts'\n"
                            "cfg.data.rewards = [accuracy_reward, {'path': format_reward, 'weight': 0.2}]\n",
                  HEAD + f"from {rewards_module} import accuracy_reward, format_reward\n")
    cfg = load_config(path)
    assert [(e.path, e.weight) for e in cfg.data.rewards] == [(f"{rewards_module}:accuracy_reward", 1.0),
                                                             (f"{rewards_module}:format_reward", 0.2)]
    assert config_dict(cfg)["data"]["rewards"][0]["path"] == f"{rewards_module}:accuracy_reward"
    assert f"path: {rewards_module}:format_reward" in to_yaml(cfg)  # config_resolved.yaml: provenance
    report = preflight(cfg)  # the recorded path imports and has a reward's signature
    assert not [e for e in report.errors if "data.rewards" in e], report.errors


def test_functions_appended_to_the_list_are_recorded_too(tmp_path, rewards_module):
    path = recipe(tmp_path, "cfg.data.rewards.append(accuracy_reward)\n"
                            "cfg.data.rewards.append({'path': format_reward, 'weight': 0.2})\n",
                  HEAD + f"from {rewards_module} import accuracy_reward, format_reward\n")
    assert [e.path for e in load_config(path).data.rewards] == [f"{rewards_module}:accuracy_reward",
                                                                f"{rewards_module}:format_reward"]


@pytest.mark.parametrize("body, why", [
    ("cfg.data.rewards = [lambda completions, **kw: [1.0] * len(completions)]\n", "a lambda has no import path"),
    ("def nested(completions, **kw):\n    return [1.0]\ncfg.data.rewards = [nested]\n",
     "build_config.nested is defined inside a function"),
    ("cfg.data.rewards = [defined_here]\n", "defined_here is defined in the recipe file"),
    ("cfg.data.rewards.append(defined_here)\n", "defined_here is defined in the recipe file"),
])
def test_a_reward_function_without_an_import_path_is_refused_with_the_fix(tmp_path, body, why):
    head = HEAD + "\n\ndef defined_here(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    (msg,) = problems_of(recipe(tmp_path, body, head))
    assert msg.startswith("data.rewards[0].path=<function ") and why in msg, msg
    assert "define it with def at the top level of a module" in msg and "{'path': 'my_rewards:" in msg


def test_a_function_of_main_or_a_callable_object_has_no_import_path():
    def fn(completions, **kwargs):
        return [1.0]

    fn.__module__, fn.__qualname__ = "__main__", "fn"
    with pytest.raises(ImportPathError, match=r"^fn is defined in the script being run \(__main__\)"):
        import_path_of(fn)

    class Scorer:
        def __call__(self, completions, **kwargs):
            return [1.0]

    with pytest.raises(ImportPathError, match="^a Scorer has no import path"):
        import_path_of(Scorer())
    assert import_path_of(import_path_of) == "rl_core.user_code:import_path_of"
