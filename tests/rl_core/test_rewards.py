"""Rewards: GSM8K strict/flexible with traps, exact numeric comparison; arithmetic exact match."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rl_core.config.schema import DataConfig
from rl_core.rewards import arithmetic_reward, get_reward_fn, gsm8k_reward, reward_fn_from_config
from rl_core.rewards.gsm8k import extract_flexible, extract_reference, extract_strict

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


def test_registry_selects_by_task_and_mode():
    assert get_reward_fn("arithmetic") is arithmetic_reward
    strict = reward_fn_from_config(DataConfig(task="gsm8k", reward_mode="strict"))
    flexible = reward_fn_from_config(DataConfig(task="gsm8k", reward_mode="flexible"))
    assert strict("it is 72", ANSWER_72) == 0.0 and flexible("it is 72", ANSWER_72) == 1.0
    with pytest.raises(ValueError, match="task"):
        get_reward_fn("chess")


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
