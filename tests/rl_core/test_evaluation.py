"""Held-out accuracy (rl_core/evaluation/heldout.py): the share of completions the success reward (`data.success_reward`,
default the first reward) gives full marks by its own value, whatever the weights; checked before the run
(preflight) and the same through the reward pool's scorer.

A canned engine answers each prompt with a fixed text, so every number below is worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_core.config import load_config
from rl_core.config.schema import DataConfig
from rl_core.evaluation.heldout import evaluate_accuracy
from rl_core.model.loading import build_tiny_tokenizer
from rl_core.preflight.rules import data_problems
from rl_core.rewards import RewardFunction, reward_inputs, score_batch, success_reward, successes
from rl_core.tasks import Example

HERE = "tests.rl_core.test_evaluation"


def accuracy_reward(completions, solution, **kwargs):
    """TRL's shape: 1.0 when the completion is the row's `solution` (whitespace aside)."""
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def format_reward(completions, **kwargs):
    """1.0 when the completion is digits only (whitespace aside)."""
    return [float(c.strip().isdigit()) for c in completions]


SOLUTIONS = ["3", "46", "100", "9", "77", "84"]
REPLIES = ["3", "46 ", "10", "nine", "77!", "84"]
# by hand: accuracy_reward [1, 1, 0, 0, 0, 1]; format_reward [1, 1, 1, 0, 0, 1]
# weighted 1.0 + 0.2: [1.2, 1.2, 0.2, 0, 0, 1.2], mean 3.8 / 6; no total is exactly 1.0
ACCURACY, FORMAT = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


class Canned:
    """A rollout engine that answers the prompts, in the order they come, with `replies`."""

    def __init__(self, replies: list[str]):
        self.replies, self.calls = list(replies), 0

    def generate(self, prompt_ids, n, params):
        assert n == 1 and params.greedy
        texts, self.replies = self.replies[:len(prompt_ids)], self.replies[len(prompt_ids):]
        self.calls += 1
        return SimpleNamespace(episodes=None, decode_responses=lambda tokenizer: list(texts))


def _examples() -> list[Example]:
    return [Example(f"q{i}", "", None, {"solution": s}, f"val.jsonl:{i + 1}") for i, s in enumerate(SOLUTIONS)]


def _data(*names: str, weights=(1.0, 0.2), **fields) -> DataConfig:
    return DataConfig(task="prompts", rewards=[{"path": f"{HERE}:{n}", "weight": w} for n, w in zip(names, weights)],
                      **fields)


def _evaluate(data: DataConfig, examples=None, replies=REPLIES, **kwargs) -> dict:
    engine = Canned(replies)
    out = evaluate_accuracy(None, build_tiny_tokenizer(), examples or _examples(), data=data, engine=engine,
                            batch_size=4, **kwargs)
    assert engine.calls == 2 and not engine.replies  # two batches (4 + 2), every reply used
    return out


def test_weighted_rewards_keep_accuracy_the_first_rewards_full_marks():
    out = _evaluate(_data("accuracy_reward", "format_reward"))
    assert out["success_reward"] == "accuracy_reward"
    assert out["accuracy"] == 3 / 6  # a total of exactly 1.0 would count none of them
    assert out["mean_reward"] == pytest.approx(3.8 / 6)
    assert out["n"] == 6


def test_the_default_is_the_first_reward_and_data_success_reward_names_another():
    first_format = _evaluate(_data("format_reward", "accuracy_reward", weights=(0.2, 1.0)))
    assert (first_format["success_reward"], first_format["accuracy"]) == ("format_reward", 4 / 6)
    named = _evaluate(_data("format_reward", "accuracy_reward", weights=(0.2, 1.0), success_reward="accuracy_reward"))
    assert (named["success_reward"], named["accuracy"]) == ("accuracy_reward", 3 / 6)
    assert named["mean_reward"] == first_format["mean_reward"] == pytest.approx(3.8 / 6)  # the weights are unchanged
    assert [s["correct"] for s in named["samples"]] == [True, True, False, False]  # the first 4 (num_samples)
    assert [s["reward"] for s in named["samples"]] == pytest.approx([1.2, 1.2, 0.2, 0.0])


def test_the_tasks_own_0_1_reward_gives_the_share_of_exact_answers():
    examples = [Example(p, a) for p, a in (("1+2=", "3"), ("4+4=", "8"), ("9+9=", "18"), ("5+0=", "5"), ("2+2=", "4"),
                                           ("1+1=", "2"))]
    own = _evaluate(DataConfig(), examples, replies=["3", "9", "18 ", "50", "4", "2"])
    assert (own["success_reward"], own["accuracy"], own["mean_reward"]) == ("arithmetic", 4 / 6, 4 / 6)


def test_a_success_reward_that_does_not_apply_or_scores_below_one_is_not_correct():
    functions = [RewardFunction("graded", lambda completions, **_: [1.5, 1.0, 0.999, None]),
                 RewardFunction("other", lambda completions, **_: [1.0] * 4)]
    scores = score_batch(functions, reward_inputs([Example(f"q{i}", "a") for i in range(4)], ["a"] * 4))
    assert scores.values == {"graded": [1.5, 1.0, 0.999, None], "other": [1.0] * 4}
    assert scores.rewards == [2.5, 2.0, 1.999, 1.0]
    assert successes(scores, "graded") == [True, True, False, False]


def test_an_unknown_success_reward_is_refused_by_name_before_the_run():
    with pytest.raises(ValueError, match=r"data.success_reward='accuracy'.*'accuracy_reward', 'format_reward'"):
        success_reward("accuracy", ["accuracy_reward", "format_reward"])
    assert success_reward(None, ["a", "b"]) == "a" and success_reward("b", ["a", "b"]) == "b"
    rewards = ("data.rewards=[{path: 'examples.own_data:answer_digits', weight: 0.8}, "
               "{path: 'examples.own_data:within_length', weight: 0.2, name: short}]")
    cfg = load_config("recipes/arithmetic.py", [rewards, "data.success_reward=within_length"])
    (problem,) = data_problems(cfg)
    assert problem.startswith("data.success_reward='within_length': no reward of that name; the rewards are "
                              "'answer_digits', 'short'")
    assert data_problems(load_config("recipes/arithmetic.py", [rewards, "data.success_reward=short"])) == []
    # the task's own reward by its name; an agent task's environment reward
    assert data_problems(load_config("recipes/arithmetic.py", ["data.success_reward=arithmetic"])) == []
    (problem,) = data_problems(load_config("recipes/grpo_gsm8k_cpu.py", ["data.success_reward=arithmetic"]))
    assert "the rewards are 'gsm8k_strict'" in problem
