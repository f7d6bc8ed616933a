"""User code by import path: the algorithm registry, `rl.custom_objective` and `data.rewards`.

The toy objective and the reward live in `tests/user_code.py`, outside the package, as a user's would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.config import ConfigError, load_config
from rl_core.config.preflight import check, preflight
from rl_core.registry import ALGORITHMS, algorithm, build_objective, names
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

def test_every_recipe_algorithm_is_registered_with_a_flow_and_a_builder():
    from flows.entry import FLOWS, flow_for

    for name, spec in ALGORITHMS.items():
        assert spec.topology in FLOWS and callable(flow_for(name).fn)
    assert names(group_relative=True) == ("grpo", "dr_grpo", "gspo", "legacy_pg", "opd")
    assert names(topology="offline") == ("dpo",)
    for path in sorted(Path(ARITH).parent.glob("*.py")):
        if path.name.startswith("_") or "build_config" not in path.read_text():
            continue
        cfg = load_config(str(path), [])
        assert cfg.job.algorithm in ALGORITHMS, path
        assert not [e for e in preflight(cfg).errors if "requires rl." in e], path  # label and math agree


def test_an_unknown_algorithm_lists_the_registered_ones():
    (msg,) = errors("job.algorithm=ppo")
    assert "job.algorithm" in msg and "'ppo'" in msg
    assert all(name in msg for name in ALGORITHMS)


@pytest.mark.parametrize("overrides, knob", [
    (("job.algorithm=grpo",), "rl.grpo_surrogate=legacy_pg"),  # the quickstart recipe pins legacy_pg
    (("job.algorithm=legacy_pg", "rl.grpo_surrogate=clipped"), "rl.grpo_surrogate=clipped"),
    (("job.algorithm=gspo", "rl.grpo_surrogate=clipped", "rl.lower_bound_ratio=0", "rl.temperature=1.0"),
     "rl.importance_sampling_level=token"),
    (("job.algorithm=dr_grpo", "rl.grpo_surrogate=clipped"), "rl.unbiased_advantage=false"),
])
def test_the_algorithm_label_and_the_math_cannot_disagree(overrides, knob):
    """`job.algorithm=legacy_pg rl.grpo_surrogate=clipped` used to pass silently: the label was never checked."""
    found = [e for e in errors(*overrides) if e.startswith(knob)]
    assert found and "requires" in found[0] and f"job.algorithm={overrides[0].split('=')[1]}" in found[0], errors(*overrides)


def test_the_registry_owns_the_per_algorithm_rules():
    spec = algorithm("dpo")
    assert "epsilon_high" in spec.unread and spec.topology == "offline" and not spec.group_relative
    msg = [e for e in errors("rl.dpo_beta=0.5") if e.startswith("rl.dpo_beta")]
    assert msg and "only read by job.algorithm=dpo" in msg[0]
    with pytest.raises(ValueError, match="known: grpo"):
        algorithm("nope")


def test_surrogates_are_registered_functions_and_the_schema_offers_exactly_those():
    import typing

    from rl_core.algorithms.surrogates import SURROGATES, surrogate
    from rl_core.config.schema import RLConfig

    allowed = typing.get_args(RLConfig.model_fields["grpo_surrogate"].annotation)
    assert set(allowed) == set(SURROGATES)
    assert surrogate("clipped").reads_old_logp and not surrogate("legacy_pg").reads_old_logp
    with pytest.raises(ValueError, match="expected one of clipped, legacy_pg"):
        surrogate("gspo")


# ----------------------------------------------------------------------------------------- user code

@pytest.mark.parametrize("override, expected", [
    ("rl.custom_objective=examples.custom_objective:missing", "has no 'missing'"),
    ("rl.custom_objective=no_such_package.losses:build", "cannot import module 'no_such_package.losses'"),
    ("rl.custom_objective=tests.user_code:objective_with_one_argument", "cannot be called as objective_with_one_argument(rl, context)"),
    ("rl.custom_objective=tests.user_code:NOT_A_FUNCTION", "is a int, not a function"),
    ("data.rewards=[{path: 'tests.user_code:reward_without_completions'}]", "cannot be called as reward_without_completions(completions=...)"),
    ("data.rewards=[{path: 'tests/user_code.py'}]", "data.rewards"),
    ("data.task=tests.user_code:NOT_A_FUNCTION", "int is not a rl_core.tasks.Task"),
])
def test_a_wrong_path_or_signature_is_refused_naming_the_key(override, expected):
    key = override.split("=")[0]
    found = [e for e in errors(override) if e.startswith(key) or key in e]
    assert found and expected in found[0], errors(override)
    with pytest.raises(ConfigError):  # what the flows and `posttrain validate` run
        check(load_config(ARITH, [override]))


def test_a_builder_that_returns_something_else_is_refused_when_built():
    from rl_core.algorithms.context import ObjectiveContext

    cfg = load_config(ARITH, ["rl.custom_objective=tests.user_code:not_an_objective"])
    with pytest.raises(ValueError, match=r"rl.custom_objective: the builder returned a Tensor, not an .*Objective"):
        build_objective(cfg, ObjectiveContext.from_config(cfg))


def test_the_custom_objective_is_part_of_the_run_identity():
    from rl_core.algorithms.context import ObjectiveContext

    cfg = load_config(ARITH, [f"rl.custom_objective={OBJECTIVE}"])
    identity = build_objective(cfg, ObjectiveContext.from_config(cfg)).identity
    assert identity["custom_objective"] == OBJECTIVE and identity["objective"] == "clipped_advantage_pg"
    assert identity["policy"]["name_or_path"] == cfg.model.name_or_path


@pytest.mark.slow
def test_a_custom_objective_and_reward_train_three_steps_through_the_flow(cwd):
    """The example objective (only it emits `advantage_clip_frac`) trains 3 steps in the Ray trainer; the custom
    reward scores every completion: each step's mean reward equals the mean of len(answer)/10 over its prompts,
    computed here from the data, to within the reward's 1e-3 completion term."""
    from flows.grpo import grpo

    grpo(ARITH, [*FAST, "job.name=custom", "rl.max_steps=3", "rl.validation.every_steps=0",
                 "rl.validation.before_training=false", f"rl.custom_objective={OBJECTIVE}",
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
