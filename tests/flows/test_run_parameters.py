"""The training flows' parameters (flows/params.py): the schema Prefect builds from them (the UI's run form), the
typed knobs as overrides, and the guard on what a run created on the API may change."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, recipe

KNOB_TYPES = {"max_steps": "integer", "lr": "number", "seed": "integer", "experiment": "string"}


@pytest.mark.parametrize("name", ["grpo", "opd", "dpo"])
def test_the_flow_parameter_schema_is_typed_and_described(name):
    """What the Prefect UI draws its run form from: every parameter described, the knobs typed, each knob saying
    which config key it sets (from the config schema's own description)."""
    import importlib

    from prefect.utilities.callables import parameter_schema

    flow = getattr(importlib.import_module(f"flows.{name}"), name)
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    props = schema["properties"]
    assert schema["required"] == ["recipe"]
    assert props["recipe"]["type"] == "string" and "recipes/" in props["recipe"]["description"]
    assert {"items": {"type": "string"}, "type": "array"} in props["overrides"]["anyOf"]
    assert "key=value" in props["overrides"]["description"]
    assert props["knobs"]["$ref"] == "#/definitions/RunKnobs" and props["knobs"]["description"]
    knobs = schema["definitions"]["RunKnobs"]
    assert knobs["additionalProperties"] is False  # a misspelt knob is refused, not ignored
    from flows.params import RunKnobs

    for knob, kind in KNOB_TYPES.items():
        field = knobs["properties"][knob]
        assert {"type": kind} in field["anyOf"] and field["default"] is None
        assert field["description"].startswith(RunKnobs.KEYS[knob] + ": ")
    assert flow.parameters.model_dump_for_openapi() == schema  # what `prefect deploy` sends is this schema


def test_knobs_are_overrides_of_allowed_keys_and_a_key_given_twice_is_refused():
    from pydantic import ValidationError

    from flows.guard import API_OVERRIDES, deployment_problems
    from flows.params import RunKnobs, run_overrides
    from rl_core.config import ConfigError, load_config

    overrides = run_overrides(["rollout.n=4"], {"max_steps": 20, "lr": 1e-5, "experiment": "sweep a"})
    assert overrides == ["rollout.n=4", "rl.max_steps=20", "rl.optimizer.lr=1e-05", "tracking.experiment=sweep a"]
    cfg = load_config(recipe("arithmetic"), overrides)
    assert (cfg.rl.max_steps, cfg.rl.optimizer.lr, cfg.tracking.experiment) == (20, 1e-5, "sweep a")
    assert run_overrides(None, None) == [] and run_overrides(["job.seed=3"], RunKnobs()) == ["job.seed=3"]
    with pytest.raises(ConfigError, match="rl.max_steps: given both in knobs and in overrides"):
        run_overrides(["rl.max_steps=5"], {"max_steps": 20})
    with pytest.raises(ValidationError):
        RunKnobs.model_validate({"max_step": 20})
    with pytest.raises(ValidationError):
        RunKnobs.model_validate({"max_steps": "many"})
    # every knob passes the guard of a run created on the API, so a caller may use the form
    assert set(RunKnobs.KEYS.values()) <= API_OVERRIDES
    knobs = {"max_steps": 3, "lr": 2e-4, "seed": 7, "experiment": "x"}
    assert deployment_problems("recipes/arithmetic.py", run_overrides([], knobs), project=REPO,
                               allow_unsafe=False) == []
    # a knob's value is checked where every value is: by the config, naming the key
    with pytest.raises(ConfigError, match="rl.max_steps"):
        load_config(recipe("arithmetic"), run_overrides([], {"max_steps": 0}))
