"""`posttrain validate` opens one episode of an environment task on data.train's first row, as the rollout would:
a tool without a schema or a `reset` that raises is named there, with where the tool is defined, in seconds,
instead of on every row inside a run."""

from __future__ import annotations

import json

from rl_core.agents import Environment, Reply
from rl_core.config import PosttrainConfig
from rl_core.preflight.rows import check_data

HERE = "tests.rl_core.test_validate_environment"


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: which key
    """
    return key


def peek(key):  # no docstring, no type hints: no JSON schema
    return key


PEEK_LINE = peek.__code__.co_firstlineno


class Good(Environment):
    tools = (lookup,)

    def respond(self, turn) -> Reply:
        return Reply(done=True)

    def reward(self) -> float:
        return 0.0


class BareTool(Good):
    def reset(self):
        self.tools = (lookup, peek)  # tools set per row, in reset, as the docs show
        return super().reset()


class Broken(Good):
    def reset(self):
        raise ConnectionError("the row's service is down")


def config(tmp_path, task: str) -> PosttrainConfig:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ("a?", "b?")))
    cfg = PosttrainConfig()
    cfg.data.task, cfg.data.train, cfg.data.val, cfg.data.prompt_template = f"{HERE}:{task}", str(rows), str(rows), "chat"
    return cfg


def test_validate_names_a_tool_without_a_schema_and_where_it_is_defined(tmp_path):
    cfg = config(tmp_path, "BareTool")
    (problem,) = check_data(cfg, open_episode=True).errors
    assert problem.startswith(f"data.task={HERE}:BareTool: an episode on data.train's first row ({tmp_path}/rows.jsonl:1) "
                              "cannot start: BareTool's tools: ValueError: tool peek (")
    assert f"test_validate_environment.py:{PEEK_LINE}): no JSON schema" in problem
    assert check_data(cfg).ok  # the run's own data check opens no episode


def test_validate_names_a_reset_that_raises_and_passes_a_good_environment(tmp_path):
    (problem,) = check_data(config(tmp_path, "Broken"), open_episode=True).errors
    assert "cannot start: Broken.reset raised ConnectionError: the row's service is down" in problem
    assert check_data(config(tmp_path, "Good"), open_episode=True).ok
