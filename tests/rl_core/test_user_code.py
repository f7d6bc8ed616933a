"""User code by import path: the objective registry, `rl.objective.type=custom` and `data.rewards`.

The toy objective and the reward live in `tests/user_code.py`, outside the package, as a user's would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.algorithms.registry import OBJECTIVES, build_objective
from rl_core.config import ConfigError, load_config
from rl_core.preflight.rules import check, preflight
from tests.conftest import FAST, recipe

ARITH = recipe("arithmetic")
OBJECTIVE = "examples.custom_objective:build_objective"  # the example docs/objectives.md walks through
REWARD = "tests.user_code:answer_length_reward"


def errors(*overrides: str) -> list[str]:
    try:
        cfg = load_config(ARITH, list(overrides))
    except ConfigError as exc:
        return exc.problems
    return preflight(cfg).errors


# ----------------------------------------------------------------------------------------- registry

def custom(path: str, **kwargs) -> str:
    """The override that selects the custom objective `path` with `kwargs`."""
    args = ", ".join(f"{k}: {v}" for k, v in kwargs.items())
    return f"rl.objective={{type: custom, import_path: '{path}', kwargs: {{{args}}}}}"


def test_every_objective_has_a_flow_and_every_recipe_a_registered_objective():
    from flows.entry import flow_for

    for kind, cls in OBJECTIVES.items():
        objective = cls.model_construct()
        assert callable(flow_for(objective).fn) and cls.model_fields["type"].default == kind
    assert [k for k, c in OBJECTIVES.items() if c.GROUP_RELATIVE and c.TOPOLOGY != "offline"] == \
        ["grpo", "dr_grpo", "gspo", "legacy_pg", "opd", "custom"]
    assert flow_for(OBJECTIVES["dpo"].model_construct()).name == "dpo"
    assert flow_for(OBJECTIVES["opd"].model_construct()).name == "opd"
    for path in sorted(Path(ARITH).parent.glob("*.py")):
        if path.name.startswith("_") or "build_config" not in path.read_text():
            continue
        cfg = load_config(str(path), [])
        assert type(cfg.rl.objective) is OBJECTIVES[cfg.rl.objective.type], path


def test_an_unknown_objective_type_lists_the_registered_ones():
    (msg,) = errors("rl.objective.type=trpo")
    assert msg.startswith("rl.objective") and "'trpo'" in msg
    assert all(f"'{name}'" in msg for name in OBJECTIVES)


@pytest.mark.parametrize("overrides, expected", [
    (("rl.objective.type=gspo", "rl.objective.importance_sampling_level=token"), "rl.objective.importance_sampling_level='token': not one of 'sequence'"),
    (("rl.objective.type=dr_grpo", "rl.objective.unbiased_advantage=false"), "rl.objective.unbiased_advantage=False"),
    (("rl.objective.type=grpo", "rl.objective.surrogate=legacy_pg"), "rl.objective.type=legacy_pg"),
    (("rl.objective.type=grpo", "rl.objective.importance_sampling_level=sequence"), "rl.objective.type=gspo"),
])
def test_a_preset_fixes_its_values_and_names_the_type_that_matches(overrides, expected):
    """The label and the math cannot disagree: a value a type fixes is refused, naming the key (and the type that
    has it, where one does)."""
    found = [e for e in errors(*overrides) if expected in e]
    assert found, errors(*overrides)


def test_a_knob_of_another_objective_is_refused_naming_its_owner():
    msg = [e for e in errors("rl.objective.beta=0.5") if e.startswith("rl.objective.beta")]
    assert msg and "not a knob of legacy_pg" in msg[0] and "rl.objective.type=dpo" in msg[0]
    msg = [e for e in errors("rl.objective.type=dpo", "rl.objective.epsilon_high=0.3") if "epsilon_high" in e]
    assert msg and "not a knob of dpo" in msg[0]


def test_switching_the_type_keeps_what_the_recipe_set_and_drops_the_rest():
    """grpo_gsm8k sets epsilon_high=0.28 (not GRPO's default) and epsilon_low=0.2 (GRPO's default): switching to
    dr_grpo keeps 0.28; to gspo, the paper's 3e-4 replaces the default; to dpo, which has no clip, drops them."""
    dr = load_config(recipe("grpo_gsm8k"), ["rl.objective.type=dr_grpo"])
    assert dr.rl.objective.epsilon_high == 0.28 and dr.rl.objective.loss_type == "seq-mean-token-sum-fixed"
    gspo = load_config(recipe("grpo_gsm8k"), ["rl.objective.type=gspo", "rl.objective.epsilon_high=4e-4"])
    assert (gspo.rl.objective.epsilon_low, gspo.rl.objective.epsilon_high) == (3e-4, 4e-4)
    assert load_config(recipe("grpo_gsm8k"), ["rl.objective.type=dpo"]).rl.objective.beta == 0.1


def test_surrogates_and_reductions_are_registered_functions_the_config_offers():
    from rl_core.algorithms.grpo import GRPO
    from rl_core.algorithms.surrogates import SURROGATES, surrogate
    from rl_core.primitives.policy_gradient import LOSS_TYPES, REDUCTIONS

    assert list(SURROGATES) == ["clipped", "legacy_pg"] and list(REDUCTIONS) == LOSS_TYPES
    assert surrogate("clipped").reads_old_logp and not surrogate("legacy_pg").reads_old_logp
    with pytest.raises(ValueError, match="one of clipped, legacy_pg"):
        surrogate("gspo")
    with pytest.raises(ValueError, match="not a registered loss reduction"):
        GRPO(loss_type="token-sum")
    with pytest.raises(ValueError, match="not a registered surrogate"):
        GRPO(surrogate="gspo")


# ----------------------------------------------------------------------------------------- user code

@pytest.mark.parametrize("override, expected", [
    (custom("examples.custom_objective:missing"), "has no 'missing'"),
    (custom("no_such_package.losses:build"), "cannot import module 'no_such_package.losses'"),
    (custom("tests.user_code:objective_with_one_argument"), "cannot be called as objective_with_one_argument(rl, context)"),
    (custom("tests.user_code:NOT_A_FUNCTION"), "is a int, not a function"),
    (custom(OBJECTIVE, clip=1.5, width=3), "cannot be called as build_objective(rl, context, clip=..., width=...)"),
    ("data.rewards=[{path: 'tests.user_code:reward_without_completions'}]", "cannot be called as reward_without_completions(completions=...)"),
    ("data.rewards=[{path: 'tests/user_code.py'}]", "data.rewards"),
    ("data.task=tests.user_code:NOT_A_FUNCTION", "int is not a rl_core.tasks.Task"),
])
def test_a_wrong_path_or_signature_is_refused_naming_the_key(override, expected):
    key = "rl.objective.import_path" if override.startswith("rl.objective") else override.split("=")[0]
    found = [e for e in errors(override) if e.startswith(key) or key in e]
    assert found and expected in found[0], errors(override)
    with pytest.raises(ConfigError):  # what the flows and `posttrain validate` run
        check(load_config(ARITH, [override]))


def test_a_builder_that_returns_something_else_is_refused_when_built():
    from rl_core.algorithms.context import ObjectiveContext

    cfg = load_config(ARITH, [custom("tests.user_code:not_an_objective")])
    with pytest.raises(ValueError, match=r"rl.objective.import_path=.*: the builder returned a Tensor, not an .*Objective"):
        build_objective(cfg, ObjectiveContext.from_config(cfg))


def test_the_custom_objective_and_its_parameter_are_part_of_the_run_identity():
    from rl_core.algorithms.context import ObjectiveContext

    cfg = load_config(ARITH, [custom(OBJECTIVE)])
    identity = build_objective(cfg, ObjectiveContext.from_config(cfg)).identity
    assert identity["custom_objective"] == OBJECTIVE and identity["objective"] == "clipped_advantage_pg"
    assert identity["advantage_clip"] == 2.0 and "kwargs" not in identity  # the builder's default
    assert identity["policy"]["name_or_path"] == cfg.model.name_or_path
    cfg = load_config(ARITH, [custom(OBJECTIVE, clip=0.5)])
    objective = build_objective(cfg, ObjectiveContext.from_config(cfg))
    assert objective.identity["kwargs"] == {"clip": 0.5} and objective.identity["advantage_clip"] == 0.5
    assert objective.fn.clip == 0.5  # the parameter reached the loss
    with pytest.raises(ValueError, match="rl.objective.kwargs.clip=-1"):
        build_objective(load_config(ARITH, [custom(OBJECTIVE, clip=-1)]), ObjectiveContext.from_config(cfg))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_custom_objective_and_reward_train_three_steps_through_the_flow(cwd):
    """The example objective (only it emits `advantage_clip_frac`) trains 3 steps in the Ray trainer; the custom
    reward scores every completion: each step's mean reward equals the mean of len(answer)/10 over its prompts,
    computed here from the data, to within the reward's 1e-3 completion term."""
    from flows.grpo import grpo

    grpo(ARITH, [*FAST, "job.name=custom", "rl.max_steps=3", "rl.validation.every_steps=0",
                 "rl.validation.before_training=false", custom(OBJECTIVE, clip=1.5),
                 f"data.rewards=[{{path: '{REWARD}'}}]"])
    run_dir = cwd / "runs" / "custom"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    answers = [json.loads(line)["answer"] for line in (cwd / "data" / "arithmetic" / "train.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        want = sum(len(answers[i]) for i in r["data/prompt_rows"]) / len(r["data/prompt_rows"]) / 10
        assert r["rollout/reward_mean"] == pytest.approx(want, abs=1e-3 + 1e-9)
        assert 0 <= r["train/advantage_clip_frac"] <= 1  # a metric only the example objective emits
    assert "val/mean_reward" in records[-1]
    final = load_file(run_dir / "final_model" / "model.safetensors")
    init = load_file(next((cwd / "artifacts" / "tiny-model" / "init").glob("*.safetensors")))
    assert any(not torch.equal(final[k], init[k]) for k in init)  # the objective's gradients moved the weights
