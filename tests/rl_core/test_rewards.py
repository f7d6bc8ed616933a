"""Rewards: GSM8K strict/flexible with traps, exact numeric comparison; arithmetic exact match; TRL-style reward
functions with weights, None and the checks that name the function and the row."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rl_core.config.schema import DataConfig
from rl_core.rewards import RewardError, RewardFunction, reward_inputs, score
from rl_core.rewards.arithmetic import arithmetic_reward
from rl_core.rewards.configured import reward_functions
from rl_core.rewards.gsm8k import extract_flexible, extract_reference, extract_strict, gsm8k_reward

ANSWER_72 = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
)


@pytest.mark.parametrize(
    "completion, strict, flexible",
    [
        ("48 + 24 = 72\n#### 72", 1.0, 1.0),
        ("#### 72", 1.0, 1.0),
        ("####72", 1.0, 1.0),
        # answer followed by more text: no truncation window, strict still finds it
        ("#### 72\n" + "Let me double-check this reasoning carefully. " * 40 + "Yes.", 1.0, 1.0),
        ("#### 72\nThat took 3 steps.", 1.0, 0.0),
        # several ####: the last one counts
        ("#### 70\nWait, I made a mistake.\n#### 72", 1.0, 1.0),
        ("#### 72\nWait, I made a mistake.\n#### 70", 0.0, 0.0),
        ("#### 72\n####", 1.0, 1.0),  # a bare trailing #### has no number: the last #### N is 72
        # no #### at all: strict fails, flexible reads the last number
        ("She sold 72 clips altogether.", 0.0, 1.0),
        ("The answer is 72.", 0.0, 1.0),
        ("72.0", 0.0, 1.0),
        ("#### 72.00", 1.0, 1.0),
        ("#### $72", 1.0, 1.0),
        ("#### 72.", 1.0, 1.0),
        ("#### 7.2", 0.0, 0.0),
        ("#### 720", 0.0, 0.0),
        ("#### 172", 0.0, 0.0),
        ("#### -72", 0.0, 0.0),
        ("no number at all", 0.0, 0.0),
        ("", 0.0, 0.0),
        ("####", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(completion, strict, flexible):
    assert gsm8k_reward(completion, ANSWER_72, mode="strict") == strict
    assert gsm8k_reward(completion, ANSWER_72, mode="flexible") == flexible


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("#### 1,000", "#### 1000"),
        ("The total is $1,234,567.", "#### 1234567"),
        ("#### -5", "#### -5"),
        ("so the change is -$5", "#### -5"),
        ("#### \u22125", "#### -5"),
        ("#### 0.5", "#### .5"),
        ("#### 3.75", "#### 3.75"),
        ("#### 18.0", "#### 18"),
        ("#### 18", "#### 18.0"),
    ],
)
def test_numeric_normalisation_matches(completion, reference):
    assert gsm8k_reward(completion, reference, mode="strict" if "####" in completion else "flexible") == 1.0


def test_exact_comparison_not_float_fuzz():
    assert gsm8k_reward("#### 0.30000000000000004", "#### 0.3") == 0.0
    assert gsm8k_reward("#### 3.750001", "#### 3.75") == 0.0
    assert gsm8k_reward("#### 5", "#### -5") == 0.0


def test_empty_or_numberless_reference_never_scores():
    for completion in ("", "#### 0", "0", "anything 12"):
        assert gsm8k_reward(completion, "", mode="flexible") == 0.0
        assert gsm8k_reward(completion, "#### ", mode="strict") == 0.0


def test_extractors():
    assert extract_strict("a #### 1,234 b #### 9,876.5 c") == Decimal("9876.5")
    assert str(extract_flexible("values 1, 2, 3")) == "3"
    assert str(extract_flexible("1,2,3")) == "3"  # not one number "123"
    assert str(extract_reference(ANSWER_72)) == "72"
    assert str(extract_reference("42")) == "42"
    assert extract_strict("no hashes 5") is None
    with pytest.raises(ValueError, match="mode"):
        gsm8k_reward("#### 1", "#### 1", mode="lenient")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("46", "46", 1.0),
        (" 46 ", "46", 1.0),
        ("46\n", "46", 1.0),
        ("460", "46", 0.0),
        ("4", "46", 0.0),
        ("46+1", "46", 0.0),
        ("046", "46", 0.0),
        ("", "46", 0.0),
        ("", "", 0.0),  # empty answers never score
        ("  ", " ", 0.0),
    ],
)
def test_arithmetic_exact_match(completion, answer, expected):
    assert arithmetic_reward(completion, answer) == expected


def test_the_task_selects_its_reward_and_mode():
    from rl_core.tasks import Example

    examples = [Example("q", ANSWER_72, row="r1"), Example("q", ANSWER_72, row="r2")]
    texts = ["it is 72", "#### 72"]
    strict = score(reward_functions(DataConfig(task="gsm8k", reward_mode="strict")), reward_inputs(examples, texts))
    flexible = score(reward_functions(DataConfig(task="gsm8k", reward_mode="flexible")), reward_inputs(examples, texts))
    assert strict == ([0.0, 1.0], {"rollout/rewards/gsm8k_strict/mean": 0.5})
    assert flexible == ([1.0, 1.0], {"rollout/rewards/gsm8k_flexible/mean": 1.0})
    arith = score(reward_functions(DataConfig()), reward_inputs([Example("1+2=", "3")] * 2, ["3", "4"]))
    assert arith == ([1.0, 0.0], {"rollout/rewards/arithmetic/mean": 0.5})
    with pytest.raises(ValueError, match="data.task='chess' is not a built-in task"):
        reward_functions(DataConfig(task="chess"))


def test_whitespace_heavy_completions_are_scored_in_linear_time():
    """The number pattern once backtracked cubically over whitespace runs (500 spaces: 5 s for one completion).
    100k characters of spaces, `$` and signs must now be scored at once, and still correctly."""
    import time

    from rl_core.rewards.gsm8k import gsm8k_reward

    hostile = [" " * 100_000 + "5", "#### " + " " * 100_000 + "5", "$ - " * 25_000 + "#### 5", "\n\t " * 33_000 + "x"]
    started = time.perf_counter()
    scores = [gsm8k_reward(text, "#### 5", mode) for text in hostile for mode in ("strict", "flexible")]
    assert time.perf_counter() - started < 5.0  # measured ~0.2 s; the cubic pattern would take hours
    assert scores == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------------- TRL-style reward functions

def _chat_and_text_examples():
    from rl_core.tasks import Example

    chat = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"})
    return [Example("1+1=", "2", None, {"answer": "2", "unit": "cm"}, "f.jsonl:1"),
            Example("2+2?", "4", chat, {"answer": "4", "unit": None}, "f.jsonl:2")]


def test_functions_get_prompts_completions_and_columns_as_trl_passes_them():
    seen = {}

    def everything(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [0.0, 0.0]

    def only_answer(completions, answer):  # no **kwargs: gets only what it names
        seen["only_answer"] = answer
        return [1.0, 1.0]

    functions = [RewardFunction("e", everything), RewardFunction("a", only_answer)]
    score(functions, reward_inputs(_chat_and_text_examples(), ["2", "four"]))
    assert seen["prompts"] == ["1+1=", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]]
    assert seen["completions"] == ["2", [{"role": "assistant", "content": "four"}]]
    assert seen["answer"] == ["2", "4"] and seen["unit"] == ["cm", None] and seen["only_answer"] == ["2", "4"]


def test_weighted_sum_over_the_functions_that_apply():
    def graded(completions, **_):
        return [0.5, 0.25]

    def only_first(completions, **_):
        return [1.0, None]  # does not apply to the second completion

    functions = [RewardFunction("g", graded, 2.0), RewardFunction("o", only_first, -0.5)]
    totals, means = score(functions, reward_inputs(_chat_and_text_examples(), ["a", "b"]))
    assert totals == [2.0 * 0.5 - 0.5 * 1.0, 2.0 * 0.25]
    assert means == {"rollout/rewards/g/mean": (0.5 + 0.25) / 2, "rollout/rewards/o/mean": 1.0}


@pytest.mark.parametrize("returned, message", [
    (lambda n: [1.0] * (n + 1), "returned 3 values for 2 completions"),
    (lambda n: [1.0, float("nan")], "returned nan for completion 1 (f.jsonl:2)"),
    (lambda n: [float("inf"), 1.0], "returned inf for completion 0 (f.jsonl:1)"),
    (lambda n: ["1", 1.0], "returned '1' for completion 0"),
    (lambda n: [True, 1.0], "returned True for completion 0"),
    (lambda n: 1.0, "returned a float, not a list"),
    (lambda n: [None, None], "completion 0 (f.jsonl:1): every reward function returned None ('bad')"),
])
def test_a_bad_result_is_refused_naming_the_function_and_the_row(returned, message):
    def bad(completions, **_):
        return returned(len(completions))

    with pytest.raises(RewardError) as info:
        score([RewardFunction("bad", bad, key="data.rewards[0]")], reward_inputs(_chat_and_text_examples(), ["a", "b"]))
    assert message in str(info.value)


def test_an_exception_is_refused_naming_the_function_and_the_first_row():
    def broken(completions, **_):
        raise KeyError("answer_key")

    with pytest.raises(RewardError, match=r"reward 'broken' \(data.rewards\[1\]\) raised KeyError: 'answer_key' "
                                          r"\(scoring 2 completions, the first from f.jsonl:1\)"):
        score([RewardFunction("broken", broken, key="data.rewards[1]")],
              reward_inputs(_chat_and_text_examples(), ["a", "b"]))


def test_data_rewards_are_imported_with_their_weights_and_names():
    cfg = DataConfig(rewards=[{"path": "tests.user_code:length_reward", "weight": 0.5},
                              {"path": "tests.user_code:unit_reward", "weight": 2.0, "name": "units"}])
    functions = reward_functions(cfg)
    assert [(f.name, f.weight, f.key) for f in functions] == [("length_reward", 0.5, "data.rewards[0]"),
                                                             ("units", 2.0, "data.rewards[1]")]
    totals, means = score(functions, reward_inputs(_chat_and_text_examples(), ["abcd", "four"]))
    # length_reward: len(text)/10; unit_reward: 1 when the completion names the row's unit, None without a unit
    assert totals == pytest.approx([0.5 * 0.4 + 2.0 * 0.0, 0.5 * 0.4])
    assert means == pytest.approx({"rollout/rewards/length_reward/mean": 0.4, "rollout/rewards/units/mean": 0.0})


def test_a_verl_compute_score_wraps_in_one_line():
    from examples.own_data import verl_style  # the docs' example of wrapping compute_score

    examples = _chat_and_text_examples()
    totals, _ = score([RewardFunction("verl", verl_style)], reward_inputs(examples, ["2", "five"]))
    assert totals == [1.0, 0.0]
