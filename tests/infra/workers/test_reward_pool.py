"""The reward pool: TRL-style functions in Ray actors, each scoring a share of the batch; the same rewards as
in the driver, a timeout that names the slow function, a failure that names the function and row, and a pool
that serves the next batch after either."""

from __future__ import annotations

import time
import traceback

import pytest

from rl_core.config import load_config
from rl_core.rewards import RewardError, reward_inputs, score, score_batch
from rl_core.rewards.configured import reward_functions
from rl_core.tasks import Example

REWARDS = ("data.rewards=[{path: 'tests.user_code:length_reward', weight: 0.5}, "
           "{path: 'tests.user_code:unit_reward', weight: 2.0, name: units}]")


def _batch(n: int):
    examples = [Example(f"{i}+1=", str(i + 1), None, {"answer": str(i + 1), "unit": None if i % 3 else "cm"},
                        f"f.jsonl:{i + 1}") for i in range(n)]
    texts = [("cm " if i % 2 else "") + "x" * (i % 5) for i in range(n)]
    return reward_inputs(examples, texts)


def test_in_process_the_pool_gives_each_functions_values_by_name():
    from infra.workers.rewards import RewardPool

    cfg = load_config("recipes/arithmetic.py", [REWARDS, "data.reward_workers=0"])
    scores = RewardPool(cfg).scores(_batch(6))  # no actors: nothing is placed
    # texts "", "cm x", "xx", "cm xxx", "xxxx", "cm "; a unit ("cm") on rows 0 and 3 only
    assert list(scores.values) == ["length_reward", "units"]
    assert scores.values["length_reward"] == pytest.approx([0.0, 0.4, 0.2, 0.6, 0.4, 0.3])
    assert scores.values["units"] == [0.0, None, None, 1.0, None, None]
    assert scores.rewards == pytest.approx([0.0, 0.2, 0.1, 0.3 + 2.0, 0.2, 0.15])  # 0.5 · length + 2 · units
    assert scores.means == pytest.approx({"rollout/rewards/length_reward/mean": 1.9 / 6,
                                          "rollout/rewards/units/mean": 0.5})


def test_in_process_a_judge_and_a_weight_zero_rule_combine_and_the_judges_counts_are_logged(monkeypatch):
    """An endpoint judge is called from the driver (here one that never answers: every judgement fails, counted,
    at its unparsable_value), beside a rule reward at weight 0 that only decides accuracy."""
    from infra.workers.rewards import RewardPool

    monkeypatch.setattr("rl_core.rewards.judge.time.sleep", lambda s: None)
    judge = ("data.rewards=[{judge: {endpoint: 'http://127.0.0.1:9/v1', endpoint_model: m, retries: 1, timeout_s: 2, "
             "unparsable_value: 0.25}, name: j}, {path: 'tests.user_code:length_reward', weight: 0.0}]")
    scores = RewardPool(load_config("recipes/arithmetic.py", [judge, "data.reward_workers=0"])).scores(_batch(4))
    assert scores.values["j"] == [0.25] * 4 and scores.rewards == pytest.approx([0.25] * 4)
    assert scores.means["rollout/rewards/j/failed"] == 1.0 and scores.means["rollout/rewards/j/unparsable"] == 0.0
    assert scores.values["length_reward"] == pytest.approx([0.0, 0.4, 0.2, 0.6])  # scored, weighing nothing


@pytest.mark.e2e  # the reward workers are Ray actors
def test_the_pool_scores_what_the_driver_scores_and_names_slow_and_broken_functions():
    from infra.workers.rewards import RewardPool

    cfg = load_config("recipes/arithmetic.py", [REWARDS, "data.reward_workers=3", "data.reward_timeout_s=2"])
    inputs = _batch(11)  # 11 completions in shares of 4, 3, 4
    with RewardPool(cfg) as pool:
        assert len(pool.actors) == 3
        assert pool.score(inputs) == score(reward_functions(cfg.data), inputs)
        assert pool.scores(inputs) == score_batch(reward_functions(cfg.data), inputs)  # each function's values too

        slow = cfg.model_copy(deep=True)
        slow.data.rewards[1].path = "tests.user_code:sleepy_reward"
        with RewardPool(slow) as sleepy:
            began = time.monotonic()
            with pytest.raises(RewardError, match=r"reward 'units' \(data.rewards\[1\]\) did not return within "
                                                  r"data.reward_timeout_s=2 s on completions 0\.\.3 \(the first from f\.jsonl:1\)"):
                sleepy.score(inputs)
            # length_reward answers at once, units sleeps: the second call of each actor is due by 2 timeouts
            assert time.monotonic() - began < 2 * 2 + 3
            assert sleepy.actors == []  # killed: the next batch starts on fresh actors

        rows = _batch(4)
        rows.columns["unit"] = ["cm", "cm", "cm", 5]  # unit_reward: `5 in text` raises TypeError on row 4
        with pytest.raises(RewardError, match=r"reward 'units' \(data.rewards\[1\]\) raised TypeError"):
            pool.score(rows)
        assert pool.score(inputs) == score(reward_functions(cfg.data), inputs)  # the pool still serves

        # an API key in what a reward raises in its worker reaches neither the error nor anything chained to it
        leaky = cfg.model_copy(deep=True)
        leaky.data.rewards[1].path, leaky.data.reward_workers = "tests.user_code:leaky_reward", 1
        with RewardPool(leaky) as leaking, pytest.raises(RewardError) as raised:
            leaking.score(inputs)
        assert "reward 'units' (data.rewards[1]) raised PermissionError: the judge API refused key ***" in str(raised.value)
        assert raised.value.__cause__ is None and raised.value.__context__ is None
        assert "judge0123456789" not in "".join(traceback.format_exception(raised.value))

        # a reward that ends its own worker's process: a RewardError naming it, which the flow never takes for a
        # lost trainer (no re-placement of every role); the pool starts fresh workers for the next batch
        from flows.restarts import lost_actor

        exiting = cfg.model_copy(deep=True)
        exiting.data.rewards[1].path, exiting.data.reward_workers = "tests.user_code:exiting_reward", 1
        with RewardPool(exiting) as dying:
            # the driver may also lose the result of the call before it (sent, but not yet read, when the process
            # ended): the error names each call whose result did not come back, the exiting one always
            with pytest.raises(RewardError, match=r"a reward worker's process ended while scoring completions 0\.\.10 "
                                                  r".*before reward .*'units' \(data.rewards\[1\]\) returned") as raised:
                dying.score(inputs)
            assert raised.value.__context__ is None and not lost_actor(raised.value)
            assert dying.actors == []  # killed: the next batch starts on fresh actors
