"""data.task=reasoning_gym (rl_core/tasks/reasoning_gym.py, docs/agents.md): reasoning-gym's procedural problems by
name, seed and size, scored by the library's own scorers."""

from __future__ import annotations

import pytest
import reasoning_gym as rg

from rl_core.config import PosttrainConfig
from rl_core.rewards import call_reward, reward_inputs
from rl_core.rewards.configured import reward_functions
from rl_core.tasks import get_task, load_examples
from rl_core.tasks.reasoning_gym import parse_source


def data(**overrides):
    cfg = PosttrainConfig()
    cfg.data.task = "reasoning_gym"
    for key, value in overrides.items():
        setattr(cfg.data, key, value)
    return cfg.data


def test_a_split_is_the_librarys_problems_for_its_name_seed_and_size():
    examples = load_examples("leg_counting:7:5", "reasoning_gym", data())
    library = rg.create_dataset("leg_counting", seed=7, size=5)
    assert [e.prompt for e in examples] == [library[i]["question"] for i in range(5)]
    assert [e.answer for e in examples] == [str(library[i]["answer"]) for i in range(5)]
    assert [e.columns["rg_index"] for e in examples] == list(range(5))
    assert load_examples("leg_counting:7:5", "reasoning_gym", data()) == examples  # the same anywhere
    assert load_examples("leg_counting:8:5", "reasoning_gym", data()) != examples
    mixed = load_examples("leg_counting+chain_sum:0:12", "reasoning_gym", data())
    sources = {rg.create_dataset("composite", seed=0, size=12, datasets=[
        rg.composite.DatasetSpec("leg_counting", 1.0, {}), rg.composite.DatasetSpec("chain_sum", 1.0, {})])[i]
        ["metadata"]["source_dataset"] for i in range(12)}
    assert len(mixed) == 12 and sources == {"leg_counting", "chain_sum"}


def test_the_reward_is_the_librarys_score_of_the_tagged_answer():
    examples = load_examples("leg_counting:0:4", "reasoning_gym", data())
    [function] = reward_functions(data(), get_task("reasoning_gym"))
    assert function.name == "reasoning_gym" and function.weight == 1.0
    library = rg.create_dataset("leg_counting", seed=0, size=4)

    def score(texts):
        return call_reward(function, reward_inputs(examples, texts))

    assert score([f"Counting legs... <answer>{e.answer}</answer>" for e in examples]) == [1.0] * 4
    assert score([f"<answer>{int(e.answer) + 1}</answer>" for e in examples]) == [
        float(library.score_answer(str(int(library[i]["answer"]) + 1), library[i])) for i in range(4)]
    assert score([e.answer for e in examples]) == [0.0] * 4  # no answer tags: no answer
    chat = [[{"role": "assistant", "content": f"<answer>{e.answer}</answer>"}] for e in examples]
    assert function.fn([e.prompt for e in examples], chat, rg_source=[e.columns["rg_source"] for e in examples],
                       rg_index=[e.columns["rg_index"] for e in examples]) == [1.0] * 4


def test_the_prompt_carries_the_librarys_system_prompt_unless_the_config_sets_one():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    task = get_task("reasoning_gym")
    [example] = load_examples("leg_counting:0:1", "reasoning_gym", data())
    assert task.messages(example, data()) == [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                                              {"role": "user", "content": example.prompt}]
    assert task.messages(example, data(system_prompt="Be brief."))[0] == {"role": "system", "content": "Be brief."}
    assert task.plain_text(example, data()).startswith(SYSTEM_PROMPTS["default"])
    assert task.supervised_target(example) == f"<answer>{example.answer}</answer>"


@pytest.mark.parametrize("source, match", [("leg_counting", "NAME"), ("leg_counting:0", "NAME"),
                                           ("leg_counting:0:0", "NAME"), ("Leg:0:5", "NAME"),
                                           ("no_such_task:0:5", "no dataset no_such_task")])
def test_a_bad_split_is_refused_saying_the_form_or_the_missing_dataset(source, match):
    with pytest.raises(ValueError, match=match):
        load_examples(source, "reasoning_gym", data())


def test_parse_source():
    assert parse_source("a+b_c:3:10") == (("a", "b_c"), 3, 10)
