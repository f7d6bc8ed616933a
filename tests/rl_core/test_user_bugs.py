"""A bug in an environment's code (a programming error, `is_bug`) fails its step once, naming where in the user's
code it was raised, instead of being retried job.task_retries times into the same error: `raised_at`, the host's
`Answer.retryable`, `EnvironmentFailure.retryable` and the flows' retry condition (`flows.restarts.worth_retrying`)."""

from __future__ import annotations

import pickle

import pytest

from rl_core.agents import Environment, Reply
from rl_core.agents.host import LocalEnvironments
from rl_core.agents.rollout import EnvironmentFailure
from rl_core.tasks import Example
from rl_core.user_code import is_bug, raised_at


def parse_score(text: str) -> float:
    return float(text.split("=")[1])  # IndexError on text without '='


class Buggy(Environment):
    def respond(self, turn) -> Reply:
        return Reply(done=True)

    def reward(self) -> float:
        return parse_score(self.example.prompt)


class Offline(Environment):
    def respond(self, turn) -> Reply:
        return Reply(done=True)

    def reward(self) -> float:
        raise ConnectionError("the grader is unreachable")


BUG_LINE = parse_score.__code__.co_firstlineno + 1


def test_a_bug_is_named_where_the_users_code_raised_it_and_is_not_retryable():
    try:
        parse_score("no equals sign")
    except IndexError as exc:
        assert is_bug(exc) and raised_at(exc) == f" at {__file__}:{BUG_LINE}"
    assert not is_bug(ConnectionError("down")) and not is_bug(TimeoutError()) and not is_bug(OSError())
    assert raised_at(ValueError("never raised")) == ""  # no traceback: nothing to name

    host = LocalEnvironments()
    host.open(Buggy, [("b", Example("score", ""))])
    host.open(Offline, [("o", Example("score", ""))])
    bug, offline = host.finish(["b"]) + host.finish(["o"])
    assert bug.error == f"Buggy.reward() raised IndexError: list index out of range at {__file__}:{BUG_LINE}"
    assert bug.retryable is False
    assert offline.error.startswith("Offline.reward() raised ConnectionError: the grader is unreachable at ")
    assert offline.retryable is True


def test_the_flows_retry_every_failure_but_a_bug_in_user_code():
    from prefect.states import Failed

    from flows.restarts import worth_retrying

    bug = pickle.loads(pickle.dumps(EnvironmentFailure("rows.jsonl:1: Buggy.reward() raised ...", retryable=False)))
    assert bug.retryable is False and str(bug) == "rows.jsonl:1: Buggy.reward() raised ..."  # as Prefect keeps it
    assert worth_retrying(None, None, Failed(data=bug)) is False
    assert worth_retrying(None, None, Failed(data=EnvironmentFailure("rows.jsonl:1: down"))) is True
    assert worth_retrying(None, None, Failed(data=RuntimeError("engine lost"))) is True
    with pytest.raises(EnvironmentFailure):
        raise bug


def test_a_reward_function_with_a_bug_is_not_retried_and_one_that_lost_its_service_is():
    from rl_core.rewards import RewardError, RewardFunction, RewardInputs, call_reward

    def typo(completions, **_):
        return [len(c) for c in completions.text]  # AttributeError: a list has no `text`

    def offline(completions, **_):
        raise TimeoutError("the judge did not answer")

    inputs = RewardInputs(["1+1="], ["2"], {}, ["rows.jsonl:1"])
    with pytest.raises(RewardError, match="reward 'typo' .* raised AttributeError") as bug:
        call_reward(RewardFunction("typo", typo, key="data.rewards[0]"), inputs)
    with pytest.raises(RewardError, match="raised TimeoutError: the judge did not answer") as lost:
        call_reward(RewardFunction("offline", offline, key="data.rewards[1]"), inputs)
    assert bug.value.retryable is False and lost.value.retryable is True
    # as a reward worker sends it back (pickled), and as the flows' retry condition reads it
    from prefect.states import Failed

    from flows.restarts import worth_retrying

    assert worth_retrying(None, None, Failed(data=pickle.loads(pickle.dumps(bug.value)))) is False
    assert worth_retrying(None, None, Failed(data=pickle.loads(pickle.dumps(lost.value)))) is True


class BrokenReset(Environment):
    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.example.prompt.upper(1)}]  # TypeError: a bug


class ServerDownReset(Environment):
    def reset(self) -> list[dict]:
        raise ConnectionError("the game server is down")


class NoSchemaTool(Environment):
    def reset(self) -> list[dict]:
        self.tools = (lambda x: x,)  # no type hints, no docstring: no schema
        return super().reset()


@pytest.mark.parametrize("environment, retryable", [(BrokenReset, False), (NoSchemaTool, False),
                                                    (ServerDownReset, True)])
def test_a_step_no_row_of_which_starts_is_retried_only_when_a_retry_may_start_one(environment, retryable):
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.model.loading import build_tiny_tokenizer
    from rl_core.tasks.environment import EnvironmentTask

    task = EnvironmentTask(environment, f"tests:{environment.__name__}")
    examples = [Example("a", row="rows.jsonl:1"), Example("b", row="rows.jsonl:2")]
    with pytest.raises(EnvironmentFailure, match="no episode of this step could start: rows.jsonl:1") as failure:
        rollout_episodes(None, task, examples, build_tiny_tokenizer(), 2, None, max_turns=2, max_episode_tokens=64)
    assert failure.value.retryable is retryable
    host = LocalEnvironments()
    [opening] = host.open(environment, [("k", examples[0])])
    assert opening.retryable is retryable and opening.error is not None
