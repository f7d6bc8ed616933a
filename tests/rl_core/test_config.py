"""Typed config, recipes, dotlist overrides, error messages and preflight (docs/config.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rl_core.config import ConfigError, PosttrainConfig, config_hash, load_config, write_resolved
from rl_core.config.explain import all_keys
from rl_core.config.loader import config_from_dict
from rl_core.preflight.rules import PreflightReport, PreflightWarning, check, emit_warnings, preflight

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.py") if not p.name.startswith("_"))
GSPO = ROOT / "recipes" / "gspo_gsm8k.py"
ARITH = ROOT / "recipes" / "arithmetic.py"
GRPO = ROOT / "recipes" / "grpo_gsm8k.py"


def errors_of(recipe: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return info.value.problems


def preflight_of(recipe: Path, *overrides: str) -> PreflightReport:
    """Preflight's report, with the errors of loading (an objective's own rules) as its errors."""
    try:
        return preflight(load_config(recipe, overrides))
    except ConfigError as exc:
        return PreflightReport(errors=exc.problems)


# ------------------------------------------------------------------------------------ recipes


def test_recipe_list_covers_the_documented_recipes():
    names = {p.stem for p in RECIPES}
    assert {"arithmetic", "grpo_gsm8k", "dr_grpo_gsm8k", "gspo_gsm8k"} <= names
    for gpu in ("grpo_gsm8k", "dr_grpo_gsm8k", "gspo_gsm8k"):
        assert f"{gpu}_cpu" in names, f"{gpu} has no CPU variant"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_validates_and_round_trips(recipe, tmp_path):
    cfg = load_config(recipe)
    report = preflight(cfg)
    assert report.ok, report.render()
    path = write_resolved(cfg, tmp_path)
    assert path.name == "config_resolved.yaml"
    again = load_config(path)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)


def test_recipes_keep_variants_apart():
    cfgs = [load_config(p) for p in RECIPES]
    assert len({c.job.name for c in cfgs}) == len(cfgs), "two recipes share a job.name (outputs would collide)"


def test_gspo_recipe_resolves_to_the_paper_knobs():
    rl = load_config(GSPO).rl
    assert (rl.objective.type, rl.objective.surrogate) == ("gspo", "clipped")
    assert rl.objective.importance_sampling_level == "sequence"
    assert rl.objective.lower_bound_ratio == 0
    assert (rl.objective.epsilon_low, rl.objective.epsilon_high) == (3e-4, 4e-4)
    assert rl.objective.loss_type == "seq-mean-token-mean"
    assert rl.objective.certified_deterministic_forward is True
    assert rl.mini_batch_per_replica is not None


def test_the_gspo_type_is_the_one_place_of_its_knobs():
    """`rl.objective.type=gspo` on the GRPO recipe gives the paper's knobs (the GSPO class's defaults), except
    what the recipe set itself and GSPO has too."""
    gspo = load_config(GRPO, ["rl.objective.type=gspo", "rl.objective.epsilon_low=3e-4",
                              "rl.objective.epsilon_high=4e-4", "rl.objective.lower_bound_ratio=0"]).rl.objective
    assert gspo == load_config(GSPO).rl.objective


def test_dr_grpo_recipe_is_grpo_plus_config_only():
    dr, grpo = load_config(ROOT / "recipes" / "dr_grpo_gsm8k.py"), load_config(GRPO)
    assert dr.rl.objective.unbiased_advantage is True
    assert dr.rl.objective.loss_type == "seq-mean-token-sum-fixed"
    assert (dr.rl.objective.type, dr.job.name) == ("dr_grpo", "dr-grpo-gsm8k")
    # nothing else about the math differs from GRPO
    changed = {k for k in type(grpo.rl.objective).model_fields
               if getattr(dr.rl.objective, k) != getattr(grpo.rl.objective, k)}
    assert changed == {"type", "unbiased_advantage", "loss_type"}
    assert {k for k in type(dr.rl).model_fields if k != "objective" and getattr(dr.rl, k) != getattr(grpo.rl, k)} == set()


def test_arithmetic_root_pins_legacy_pg():
    cfg = load_config(ARITH)
    assert cfg.rl.objective.type == "legacy_pg" and cfg.rl.objective.surrogate == "legacy_pg"
    assert cfg.rollout.temperature == 1.0
    assert cfg.rollout.backend == "hf" and cfg.cluster.gpus_per_worker == 0


def test_overrides_parse_with_the_field_type():
    cfg = load_config(ARITH, ["rl.max_steps=7", "rl.optimizer.lr=3e-4", "rollout.n=4", "rl.validation.max_prompts=null",
                              "rl.optimizer.betas=[0.8, 0.9]", "job.name=x1", "model.trust_remote_code=true"])
    assert cfg.rl.max_steps == 7 and isinstance(cfg.rl.max_steps, int)
    assert cfg.rl.optimizer.lr == pytest.approx(3e-4)
    assert cfg.rl.validation.max_prompts is None
    assert cfg.rl.optimizer.betas == [0.8, 0.9]
    assert cfg.job.name == "x1" and cfg.model.trust_remote_code is True


@pytest.mark.e2e
def test_another_process_rebuilds_the_identical_config_from_path_and_dotlist():
    overrides = ["rl.max_steps=3", "rollout.n=4", "rl.optimizer.lr=1e-4"]
    here = config_hash(load_config(ARITH, overrides))
    code = ("import sys; from rl_core.config import load_config, config_hash; "
            "print(config_hash(load_config(sys.argv[1], sys.argv[2:])))")
    out = subprocess.run([sys.executable, "-c", code, str(ARITH), *overrides], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == here


def test_hash_changes_with_any_value():
    a = config_hash(load_config(ARITH))
    assert config_hash(load_config(ARITH, ["rl.optimizer.lr=6e-5"])) != a
    assert config_hash(load_config(ARITH, ["job.seed=1"])) != a


# ------------------------------------------------------------------------------ error classes


def test_unknown_key_names_the_closest_valid_keys():
    (msg,) = errors_of(ARITH, "rl.max_step=3")
    assert "rl.max_step" in msg and "unknown key" in msg and "rl.max_steps" in msg


def test_unknown_leaf_finds_its_section():
    (msg,) = errors_of(ARITH, "rl.lr=3e-4")
    assert "rl.optimizer.lr" in msg


def test_unknown_key_in_a_yaml_file_is_reported(tmp_path):
    data = json.loads(json.dumps(PosttrainConfig().model_dump(mode="json")))
    data["rollout"]["temprature"] = 0.7
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert "rollout.temprature" in str(info.value) and "rollout.temperature" in str(info.value)


def test_an_override_applies_where_the_dict_leaves_its_section_out():
    """A partial dict (a section absent, or null) takes the override; nothing is dropped silently."""
    cfg = config_from_dict({"job": {"name": "partial"}, "model": {"lora": None}},
                           ["tracking.keep_checkpoints=5", "tracking.s3.max_attempts=4", "model.lora.r=8"])
    assert (cfg.job.name, cfg.tracking.keep_checkpoints, cfg.tracking.s3.max_attempts) == ("partial", 5, 4)
    assert cfg.model.lora.r == 8 and PosttrainConfig().tracking.keep_checkpoints != 5


@pytest.mark.parametrize(
    "override, replacement",
    [("rl.objective=degenerate", "rl.objective.type=legacy_pg"),
     ("rl.objective=clipped", "rl.objective.type=grpo"),
     ("rl.objective_mode=direct", "rl.objective.distillation_mode=direct"),
     ("rl.objective_mode=advantage", "rl.objective.distillation_mode=advantage")],
)
def test_retired_keys_name_the_replacement_and_are_not_aliased(override, replacement):
    (msg,) = errors_of(ARITH, override)
    assert override.split("=")[0] in msg and "retired" in msg and replacement in msg


def test_retired_key_in_a_resolved_file_is_refused():
    data = PosttrainConfig().model_dump(mode="json")
    data["rl"]["objective"] = "degenerate"
    with pytest.raises(ConfigError, match="rl.objective.type=legacy_pg"):
        config_from_dict(data)


@pytest.mark.parametrize("override", ["rl.objective.advantage_eps=true", "rollout.n=false", "rl.objective.kl_beta=True"])
def test_bools_are_not_numbers(override):
    (msg,) = errors_of(ARITH, override)
    assert override.split("=")[0] in msg and "bool" in msg


@pytest.mark.parametrize("override", ["rl.max_steps=1.5", "rollout.n=2.5", "rl.optimizer.warmup_steps=0.1"])
def test_fractional_ints_are_refused(override):
    (msg,) = errors_of(ARITH, override)
    assert override.split("=")[0] in msg and "fractional" in msg


@pytest.mark.parametrize("override", ["rollout.n=0", "rollout.max_tokens=-4", "rl.optimizer.lr=0", "rollout.temperature=-1.0",
                                      "cluster.num_workers=0", "rl.objective.advantage_eps=0"])
def test_positive_fields_reject_zero_and_negatives(override):
    key, _ = override.split("=")
    (msg,) = errors_of(ARITH, override)
    assert msg.startswith(f"{key}=") and "must be >" in msg


@pytest.mark.parametrize("override", ["rollout.temperature=nan", "rl.optimizer.lr=inf", "rl.objective.kl_beta=-inf", "rollout.top_p=NaN"])
def test_nan_and_inf_are_refused(override):
    (msg,) = errors_of(ARITH, override)
    assert override.split("=")[0] in msg and "NaN" in msg


SECONDS = ["job.retry_delay_s", "data.reward_timeout_s", "data.env_timeout_s", "cluster.placement_timeout_s",
           "tracking.s3.connect_timeout_s", "tracking.s3.read_timeout_s"]


@pytest.mark.parametrize("key", SECONDS)
def test_a_timeout_beyond_a_week_is_refused_naming_its_key(key):
    """Issue 44, finding 6: data.reward_timeout_s=1e300 passed validation and every reward phase failed with an
    OverflowError inside Ray. Every timeout and delay is at most a week, one bound in the schema."""
    from rl_core.config import flatten
    from rl_core.config.schema import MAX_SECONDS

    assert MAX_SECONDS == 604800
    assert errors_of(ARITH, f"{key}=1e300") == [f"{key}=1e+300: must be <= 604800.0"]
    assert errors_of(ARITH, f"{key}=604800.5") == [f"{key}=604800.5: must be <= 604800.0"]
    assert flatten(load_config(ARITH, [f"{key}=604800"]))[key] == 604800  # a week itself is allowed


def test_every_seconds_field_is_bounded_by_a_week_and_retries_by_a_hundred():
    from rl_core.config.explain import field_for
    from rl_core.config.schema import MAX_SECONDS

    def upper(key: str):
        return next((m.le for m in field_for(key).metadata if getattr(m, "le", None) is not None), None)

    seconds = [k for k in all_keys() if k.endswith("_s")]
    assert sorted(seconds) == sorted(SECONDS)  # a new *_s field joins the list above, and gets the bound
    assert {k: upper(k) for k in seconds} == dict.fromkeys(seconds, MAX_SECONDS)
    assert upper("job.task_retries") == 100 and upper("job.max_restarts") == 100
    (msg,) = errors_of(ARITH, "job.task_retries=1000000000")
    assert msg == "job.task_retries=1000000000: must be <= 100"


def test_enum_errors_list_the_allowed_values():
    (msg,) = errors_of(ARITH, "rl.objective.loss_type=sum")
    for allowed in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-fixed"):
        assert allowed in msg
    assert "rl.objective.loss_type" in msg


def test_gspo_as_a_surrogate_points_to_the_sequence_level():
    (msg,) = errors_of(GRPO, "rl.objective.surrogate=gspo")
    assert msg.startswith("rl.objective.surrogate=") and "rl.objective.type=dr_grpo|gspo" in msg


def test_several_errors_are_reported_together():
    problems = errors_of(ARITH, "rl.objective=clipped", "rollout.n=0", "rl.max_steps=1.5", "rl.nope=1")
    assert len(problems) == 4
    joined = "\n".join(problems)
    for key in ("rl.objective", "rollout.n", "rl.max_steps", "rl.nope"):
        assert key in joined


def test_override_without_equals_is_a_clear_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(ARITH, ["rl.max_steps"])


def test_every_field_has_a_description():
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            sub = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
            if sub:
                yield from walk(sub, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field.description

    missing = [k for k, d in walk(PosttrainConfig, "") if not d]
    assert not missing, f"fields without a description: {missing}"
    assert len(all_keys()) > 50


# ------------------------------------------------------------------------------------- preflight


def test_one_temperature_the_trainer_follows_the_rollout():
    """rollout.temperature is the only temperature: the trainer's log-probs, pi_old and the KL reference use it."""
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.registry import build_objective

    assert preflight_of(GRPO, "rollout.temperature=0.7").ok
    cfg = load_config(GRPO, ["rollout.temperature=0.7", "rl.objective.kl_beta=0.1"])
    objective = build_objective(cfg, ObjectiveContext.from_config(cfg))
    assert objective.fn.settings.temperature == 0.7
    assert objective.old_logp_cache.scorer.temperature == objective.reference_scorer.temperature == 0.7
    assert objective.identity["temperature"] == 0.7
    assert "temperature" not in cfg.rl.model_dump()


@pytest.mark.parametrize("recipe_path", [GRPO, ARITH])
def test_the_retired_trainer_temperature_is_refused_naming_rollout_temperature(recipe_path):
    (msg,) = errors_of(recipe_path, "rl.temperature=0.7")
    assert msg.startswith("rl.temperature=0.7: retired") and "set rollout.temperature=0.7 instead" in msg


def test_temperature_contract_legacy_pg():
    assert any("rollout.temperature=1.0" in e for e in preflight_of(ARITH, "rollout.temperature=0.5").errors)
    assert preflight_of(ARITH, "rollout.temperature=1.0").ok


@pytest.mark.parametrize("knob", ["rl.objective.epsilon_low=0.1", "rl.objective.epsilon_high=0.3", "rl.objective.lower_bound_ratio=2.0",
                                  "rl.objective.importance_sampling_level=sequence", "rl.objective.certified_deterministic_forward=true",
                                  "rl.mini_batch_per_replica=16"])
def test_legacy_pg_rejects_ratio_and_pi_old_knobs(knob):
    report = preflight_of(ARITH, knob)
    assert any(e.startswith(knob.split("=")[0]) for e in report.errors), report.render()


def test_dual_clip_at_sequence_level_is_rejected_and_its_neighbour_passes():
    report = preflight_of(GSPO, "rl.objective.lower_bound_ratio=3")
    assert len(report.errors) == 1 and "dual clip" in report.errors[0] and "rl.objective.lower_bound_ratio" in report.errors[0]
    assert preflight_of(GSPO, "rl.objective.lower_bound_ratio=0").ok


def test_dual_clip_constant_must_exceed_one():
    assert any("must be > 1" in e for e in preflight_of(GRPO, "rl.objective.lower_bound_ratio=0.5").errors)
    assert preflight_of(GRPO, "rl.objective.lower_bound_ratio=1.5").ok


def test_kl_knobs_without_kl_beta_are_rejected():
    assert any(e.startswith("rl.objective.kl_estimator") for e in preflight_of(GRPO, "rl.objective.kl_estimator=k1").errors)
    assert any(e.startswith("rl.reference") for e in preflight_of(GRPO, "rl.reference=some/model").errors)
    assert preflight_of(GRPO, "rl.objective.kl_estimator=k1", "rl.objective.kl_beta=0.01").ok


def test_distillation_mode_outside_opd_is_rejected():
    assert any(e.startswith("rl.objective.distillation_mode") for e in preflight_of(GRPO, "rl.objective.distillation_mode=direct").errors)


def test_opd_direct_rejects_advantage_knobs_and_warns():
    report = preflight_of(GRPO, "rl.objective.type=opd", "rl.objective.distillation_mode=direct", "rl.objective.unbiased_advantage=true")
    assert any(e.startswith("rl.objective.unbiased_advantage") for e in report.errors)
    ok = preflight_of(GRPO, "rl.objective.type=opd", "rl.objective.distillation_mode=direct")
    assert ok.ok and any("not training signals" in w for w in ok.warnings)


def test_sequence_level_with_per_token_advantages_is_rejected():
    report = preflight_of(GRPO, "rl.objective.type=opd", "rl.objective.importance_sampling_level=sequence")
    assert any(e.startswith("rl.objective.importance_sampling_level=") and "'token'" in e for e in report.errors)


def test_reward_mode_only_for_gsm8k():
    assert any(e.startswith("data.reward_mode") for e in preflight_of(ARITH, "data.reward_mode=flexible").errors)
    assert preflight_of(GRPO, "data.reward_mode=flexible").ok


def test_group_size_must_be_at_least_two():
    assert any(e.startswith("rollout.n=1") for e in preflight_of(GRPO, "rollout.n=1").errors)


def test_batch_divisibility():
    # 64 prompts x 8 = 512 completions; 3 workers do not divide them
    assert any("cluster.num_workers=3" in e for e in preflight_of(GRPO, "cluster.num_workers=3").errors)
    # 128 per worker; 48 does not divide 128
    assert any(e.startswith("rl.mini_batch_per_replica=48") for e in preflight_of(GRPO, "rl.mini_batch_per_replica=48").errors)
    assert any(e.startswith("rl.micro_batch_per_replica=5") for e in preflight_of(GRPO, "rl.micro_batch_per_replica=5").errors)
    assert preflight_of(GRPO, "rl.mini_batch_per_replica=64", "rl.micro_batch_per_replica=16").ok


def test_warned_rows_and_their_neighbours():
    # sequence ratio at n_mini = 1
    w = preflight_of(GSPO, "rl.mini_batch_per_replica=null").warnings
    assert any("n_mini=1" in x for x in w)
    assert not preflight_of(GSPO).warnings
    # token-scale epsilons at sequence level
    assert any("token-scale" in x for x in preflight_of(GSPO, "rl.objective.epsilon_low=0.2", "rl.objective.epsilon_high=0.2").warnings)
    # top_p < 1 under a ratio surrogate
    assert any("top_p" in x for x in preflight_of(GRPO, "rollout.top_p=0.9").warnings)
    assert not preflight_of(GRPO, "rollout.top_p=1.0").warnings
    # GSPO under a token-weighted reduction
    assert any("weights sequences by length" in x for x in preflight_of(GSPO, "rl.objective.loss_type=token-mean").warnings)


def test_warnings_are_emitted_once_each():
    report = preflight_of(GRPO, "rollout.top_p=0.85")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emit_warnings(report)
        emit_warnings(report)
    mine = [w for w in caught if issubclass(w.category, PreflightWarning)]
    assert len(mine) == 1 and "top_p=0.85" in str(mine[0].message)


def test_check_raises_with_every_preflight_error():
    cfg = load_config(GSPO, ["model.teacher=artifacts/teacher", "cluster.teacher_replicas=2"])
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert len(info.value.problems) == 2


# ------------------------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False)


@pytest.mark.e2e
def test_cli_validate_refuses_dual_clip_on_gspo():
    out = run_cli("validate", "recipes/gspo_gsm8k.py", "--", "rl.objective.lower_bound_ratio=3")
    assert out.returncode == 1
    assert "dual clip" in out.stderr and "rl.objective.lower_bound_ratio" in out.stderr


@pytest.mark.e2e
def test_cli_validate_prints_the_resolved_config():
    import yaml

    out = run_cli("validate", "recipes/arithmetic.py", "--", "rl.max_steps=5")
    assert out.returncode == 0, out.stderr
    body = yaml.safe_load(out.stdout.split("# config hash")[0])
    assert body["rl"]["max_steps"] == 5 and body["rl"]["objective"]["type"] == "legacy_pg"
    assert config_hash(load_config(ARITH, ["rl.max_steps=5"])) in out.stdout


@pytest.mark.e2e
def test_cli_validate_reports_config_errors():
    out = run_cli("validate", "recipes/arithmetic.py", "--", "rl.objective=degenerate", "rollout.n=true")
    assert out.returncode == 1
    assert "rl.objective.type=legacy_pg" in out.stderr and "rollout.n" in out.stderr


@pytest.mark.e2e
def test_cli_validate_missing_recipe():
    out = run_cli("validate", "recipes/nope.py")
    assert out.returncode == 1 and "recipes/nope.py" in out.stderr


ASYNC_BASE = ("rl.objective.type=grpo", "rl.objective.surrogate=clipped", "cluster.placement=separate", "rl.async_steps=1")


def test_async_steps_needs_separate_engines_the_clipped_surrogate_and_the_grpo_loop():
    assert preflight_of(ARITH, *ASYNC_BASE).ok, preflight_of(ARITH, *ASYNC_BASE).render()
    colocated = preflight_of(ARITH, *ASYNC_BASE, "cluster.placement=colocated").errors
    assert len(colocated) == 1 and "cluster.placement=separate" in colocated[0]
    legacy = preflight_of(ARITH, "cluster.placement=separate", "rl.async_steps=1").errors  # the quickstart: legacy PG
    assert len(legacy) == 1 and "rl.objective.type=grpo" in legacy[0]
    certified = preflight_of(ARITH, *ASYNC_BASE, "rl.objective.certified_deterministic_forward=true").errors
    assert len(certified) == 1 and certified[0].startswith("rl.objective.certified_deterministic_forward")
    for other in ("opd_arithmetic.py", "dpo_arithmetic.py"):
        errors = preflight_of(ROOT / "recipes" / other, "cluster.placement=separate", "rl.async_steps=1").errors
        assert any(e.startswith("rl.async_steps=1: only the on-policy step loop") for e in errors), (other, errors)
    deeper = preflight_of(ARITH, *ASYNC_BASE, "rl.async_steps=3")  # any depth: the rollouts of 3 steps in flight
    assert deeper.ok, deeper.render()
    assert any("rl.async_steps" in e for e in errors_of(ARITH, *ASYNC_BASE, "rl.async_steps=-1"))


def test_in_flight_updates_need_rollouts_in_flight_and_the_hf_engine_and_agent_tasks_may_run_async():
    assert preflight_of(ARITH, *ASYNC_BASE, "rollout.in_flight_updates=true").ok
    idle = preflight_of(ARITH, *ASYNC_BASE, "rl.async_steps=0", "rollout.in_flight_updates=true").errors
    assert idle == [("rollout.in_flight_updates=true with rl.async_steps=0: no rollout is in flight when a sync "
                     "lands; set rl.async_steps >= 1 or remove it")]
    vllm = preflight_of(ARITH, *ASYNC_BASE, "rollout.backend=vllm", "rollout.in_flight_updates=true").errors
    assert any(e.startswith("rollout.in_flight_updates=true with rollout.backend=vllm") for e in vllm), vllm
    # multi-turn episodes: each token keeps the version that sampled it, so both are taken
    tools = ROOT / "recipes" / "tool_arithmetic.py"
    assert preflight_of(tools, *ASYNC_BASE).errors == []
    assert preflight_of(tools, *ASYNC_BASE, "rollout.in_flight_updates=true").errors == []
    routed = preflight_of(tools, *ASYNC_BASE, "model.routing_replay=rollout").errors  # no routes from episodes
    assert any(e.startswith("model.routing_replay=rollout with data.task=") for e in routed), routed


def test_engines_over_several_gpus_are_vllm_tensor_parallel_of_a_size_that_splits_the_heads(tmp_path):
    from transformers import LlamaConfig

    from rl_core.placement.run_shape import tensor_parallel_size
    from rl_core.preflight.machine import tensor_parallel_problem

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64).save_pretrained(tmp_path)
    base = [f"model.name_or_path={tmp_path}", "cluster.placement=separate", "rollout.backend=vllm"]
    arithmetic = str(ROOT / "recipes" / "arithmetic.py")
    two = load_config(arithmetic, [*base, "cluster.gpus_per_engine=2"])
    three = load_config(arithmetic, [*base, "cluster.gpus_per_engine=3"])
    assert tensor_parallel_size(two) == 2 and tensor_parallel_size(three) == 3
    assert tensor_parallel_size(load_config(arithmetic, [*base, "cluster.gpus_per_engine=1"])) == 1
    assert tensor_parallel_problem(two) is None  # 4 query heads, 2 key/value heads: 2 per GPU, 1 per GPU
    problem = tensor_parallel_problem(three)
    assert "cluster.gpus_per_engine=3" in problem and "4 query and 2 key/value heads" in problem
    assert problem.endswith(": 2, 4"), problem  # the sizes that work (4: each key/value head on 2 GPUs)
    hf = preflight(load_config(arithmetic, [*base[:2], "cluster.gpus_per_engine=2"]))
    assert any("the HF engine runs on one GPU" in e and "rollout.backend=vllm" in e for e in hf.errors), hf.errors


@pytest.mark.parametrize("overrides, needle", [
    (["cluster.sharding=hsdp"], "cluster.sharding=hsdp needs cluster.shard_size"),
    (["cluster.sharding=hsdp", "cluster.shard_size=3"], ("does not divide cluster.num_workers=4: HSDP's mesh is "
                                                         "num_workers/shard_size replicas of shard_size ranks; sizes "
                                                         "that divide: 2")),
    (["cluster.sharding=hsdp", "cluster.shard_size=4"], "one shard group over every rank is cluster.sharding=fsdp"),
    (["cluster.sharding=fsdp", "cluster.shard_size=2"], "cluster.shard_size=2 is read only by cluster.sharding=hsdp"),
])
def test_preflight_refuses_hsdp_meshes_that_do_not_divide_the_ranks(overrides, needle):
    report = preflight(load_config(str(ROOT / "recipes" / "arithmetic.py"), ["cluster.num_workers=4", *overrides]))
    assert any(needle in e for e in report.errors), report.errors


def test_the_mesh_of_each_sharding():
    from rl_core.placement.run_shape import shard_mesh

    arithmetic = str(ROOT / "recipes" / "arithmetic.py")
    mesh = lambda *o: shard_mesh(load_config(arithmetic, list(o)))
    assert mesh("cluster.num_workers=4") is None  # none: a full replica per rank
    assert mesh("cluster.num_workers=1", "cluster.sharding=fsdp") is None  # one rank: nothing to shard
    assert mesh("cluster.num_workers=4", "cluster.sharding=fsdp") == (1, 4)
    assert mesh("cluster.num_workers=8", "cluster.sharding=hsdp", "cluster.shard_size=4") == (2, 4)
    assert preflight(load_config(arithmetic, ["cluster.num_workers=8", "cluster.sharding=hsdp",
                                              "cluster.shard_size=4"])).errors == []
