"""TRL's names (rl_core/config/aliases.py, docs/coming_from_trl.md): an unknown key that TRL names leads to its key
here, a knob of another objective to the chosen objective's own, every key the table and the page name exists, and
the page's TRL script and posttrain recipe configure the same job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rl_core.algorithms.registry import OBJECTIVES
from rl_core.config import ConfigError, flatten, load_config
from rl_core.config.aliases import ALIASES
from rl_core.config.explain import all_keys, closest_keys
from rl_core.config.loader import parse_value

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "coming_from_trl.md"
GRPO = ROOT / "recipes" / "grpo_gsm8k.py"
DPO = ROOT / "recipes" / "dpo_arithmetic.py"
SECTIONS = ("job", "model", "rollout", "rl", "data", "cluster", "tracking")


def problems(recipe: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return info.value.problems


# ------------------------------------------------------------------------------------------- hints


@pytest.mark.parametrize("override, key", [
    ("rl.beta=0.04", "rl.objective.kl_beta"),
    ("beta=0.04", "rl.objective.kl_beta"),
    ("rollout.num_generations=4", "rollout.n"),
    ("num_generations=4", "rollout.n"),
    ("max_completion_length=64", "rollout.max_tokens"),
    ("rl.learning_rate=1e-5", "rl.optimizer.lr"),
    ("per_device_train_batch_size=4", "rl.micro_batch_per_replica"),
    ("save_steps=10", "rl.save_every"),
    ("output_dir=out", "job.out_dir"),
    ("rl.epsilon=0.1", "rl.objective.epsilon_low"),
    ("delta=4", "rl.objective.lower_bound_ratio"),
    ("vllm_gpu_memory_utilization=0.5", "rollout.gpu_memory_utilization"),
])
def test_a_trl_name_names_its_key(override, key):
    (msg,) = problems(GRPO, override)
    name = override.split("=")[0]
    assert msg.startswith(f"{name}: unknown key; TRL's {name.rsplit('.', 1)[-1]} is {key} here"), msg


@pytest.mark.parametrize("override, setting", [
    ("use_vllm=true", "rollout.backend=vllm"),
    ("vllm_mode=server", "cluster.placement=separate"),
    ("vllm_mode=colocate", "cluster.placement=colocated"),
    ("rl.scale_rewards=false", "rl.objective.unbiased_advantage=true"),
    ("bf16=true", "model.compute_dtype=bfloat16"),
])
def test_a_trl_value_names_the_setting_it_is_here(override, setting):
    (msg,) = problems(GRPO, override)
    assert msg.endswith(f"TRL's {override.split('=')[0].rsplit('.', 1)[-1]}={override.split('=')[1]} is {setting} here")


@pytest.mark.parametrize("override, said", [
    ("num_train_epochs=3", "rl.max_steps"),
    ("num_iterations=2", "rl.mini_batch_per_replica"),
    ("max_prompt_length=512", "refused when the data loads"),
    ("logging_steps=5", "every step's metrics are logged"),
])
def test_a_trl_name_without_an_equivalent_says_what_to_do(override, said):
    (msg,) = problems(GRPO, override)
    assert f"TRL's {override.split('=')[0]} has no equivalent here: " in msg and said in msg


def test_beta_is_the_kl_weight_of_grpo_and_the_beta_of_dpo():
    (msg,) = problems(DPO, "rl.beta=0.2")
    assert "TRL's beta is rl.objective.beta here" in msg and "kl_beta" not in msg
    (msg,) = problems(GRPO, "rl.objective.type=dpo", "rl.beta=0.2")  # the type the overrides give wins
    assert "TRL's beta is rl.objective.beta here" in msg


def test_another_objectives_knob_names_the_chosen_objectives_own():
    (msg,) = problems(GRPO, "rl.objective.beta=0.04")
    assert msg.startswith("rl.objective.beta=0.04: not a knob of grpo (read by rl.objective.type=dpo); "
                          "grpo's is rl.objective.kl_beta (TRL's beta: "), msg
    (msg,) = problems(DPO, "rl.objective.kl_beta=0.04")
    assert msg.startswith("rl.objective.kl_beta=0.04: not a knob of dpo ") and "dpo's is rl.objective.beta" in msg
    # a knob with no counterpart in the chosen objective is still simply refused
    (msg,) = problems(DPO, "rl.objective.epsilon_high=0.28")
    assert msg.endswith("remove it") and "dpo's is" not in msg


def test_a_trl_value_of_a_key_that_exists_names_the_value_here():
    (msg,) = problems(GRPO, "rl.objective.loss_type=dapo")
    assert "not a registered loss reduction" in msg and msg.endswith(
        "TRL's loss_type=dapo is rl.objective.loss_type=token-mean here")


def test_the_closest_keys_put_the_trl_names_key_first():
    """What `posttrain keys NAME` suggests."""
    assert closest_keys("rollout.num_generations")[0] == "rollout.n"
    assert closest_keys("learning_rate") == ["rl.optimizer.lr"]
    assert closest_keys("rl.beta")[0] == "rl.objective.kl_beta"
    assert closest_keys("rl.beta", objective="dpo")[0] == "rl.objective.beta"


def test_a_typo_still_gets_the_closest_keys():
    (msg,) = problems(GRPO, "rollout.temprature=0.5")
    assert msg == "rollout.temprature: unknown key; closest valid keys: rollout.temperature, rollout.max_turns, " \
                  "rollout.dtype"


# ------------------------------------------------------------------------------ the table and page


def test_every_key_of_the_alias_table_exists_and_every_objective_key_is_that_objectives():
    keys = set(all_keys())
    for name, alias in ALIASES.items():
        named = [alias.key] if alias.key else []
        named += [setting.split("=")[0] for setting in alias.values.values()]
        assert alias.key or alias.note, name
        for key in named:
            assert key in keys, f"{name}: {key} is not a key"
        for kind, key in alias.by_objective.items():
            assert key.rsplit(".", 1)[-1] in OBJECTIVES[kind].model_fields, f"{name}: {key} is not a knob of {kind}"
        for value, setting in alias.values.items():  # a setting's value is one its key takes
            key, _, raw = setting.split(" ")[0].partition("=")
            assert flatten(load_config(GRPO, [f"{key}={raw}"]))[key] == parse_value(key, raw), (name, value)


def _table() -> list[tuple[str, str]]:
    """The page's argument table: (TRL cell, posttrain cell) per row."""
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows.append((cells[0], cells[1]))
    assert len(rows) > 40
    return rows


def test_every_posttrain_key_the_page_names_exists():
    keys = set(all_keys())
    named = {token.split("=")[0] for _, cell in _table() for token in re.findall(r"`([^`]+)`", cell)}
    sections = "|".join(SECTIONS)
    named |= {t.split("=")[0] for t in re.findall(rf"`((?:{sections})\.[\w.]+(?:=\S+)?)`", PAGE.read_text())}
    assert {"rollout.n", "rl.objective.kl_beta", "rl.optimizer.lr"} <= named
    assert not {k for k in named if k.split(".")[0] in SECTIONS} - keys


def test_the_page_lists_every_trl_name_of_the_table_with_its_key():
    rows = _table()
    for name, alias in ALIASES.items():
        if not alias.trl:
            continue
        row = [cell for trl, cell in rows if f"`{name}`" in trl]
        assert row, f"{name} is not in {PAGE.name}'s table"
        assert (alias.key in row[0]) if alias.key else row[0] == "no equivalent", (name, row[0])


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)


def test_the_pages_trl_script_and_recipe_are_the_same_job(tmp_path):
    trl, recipe = _blocks()
    path = tmp_path / "my_chat.py"
    path.write_text(recipe)
    cfg = load_config(path)
    flat = flatten(cfg)
    calls = {node.func.id: node for node in ast.walk(ast.parse(trl))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    args = {k.arg: ast.literal_eval(k.value) for k in calls["GRPOConfig"].keywords}
    trainer = {k.arg: k.value for k in calls["GRPOTrainer"].keywords}
    for name, value in args.items():  # every argument is in the table, and each with a key has its value here
        alias = ALIASES[name]
        setting = alias.values.get(str(value).lower())
        if setting:
            key, _, raw = setting.split(" ")[0].partition("=")
            assert flat[key] == parse_value(key, raw), name
        elif alias.key and name != "output_dir" and not isinstance(value, list):
            assert flat[alias.by_objective.get(cfg.rl.objective.type, alias.key)] == value, name
    assert cfg.run_dir == args["output_dir"]
    assert cfg.rollout.prompts_per_step * cfg.rollout.n == \
        args["per_device_train_batch_size"] * args["gradient_accumulation_steps"]
    assert cfg.rl.mini_batch_per_replica is None and args["lr_scheduler_type"] == "constant" \
        and cfg.rl.optimizer.warmup_steps == 0
    assert ast.literal_eval(trainer["model"]) == cfg.model.name_or_path
    assert [e.path.rsplit(":", 1)[1] for e in cfg.data.rewards] == [n.id for n in trainer["reward_funcs"].elts]
    assert [e.path.split(":")[0] for e in cfg.data.rewards] == ["examples.chat_arithmetic"] * 2
    assert [e.weight for e in cfg.data.rewards] == args["reward_weights"]
    assert (cfg.data.train, cfg.data.val) == ("data/chat-arithmetic/train.jsonl", "data/chat-arithmetic/val.jsonl")
    assert 'data_files={"train": "data/chat-arithmetic/train.jsonl",' in trl and \
        '"test": "data/chat-arithmetic/val.jsonl"}' in trl
