"""Environments written with `verifiers` (tests/fixtures/verifiers_envs: a single-turn environment with a weighted
rubric, a ToolEnv, a MultiTurnEnv and an EnvGroup of two, in verifiers' own API) run unchanged in verifiers' own
Python (`make verifiers-venv`), against the gateway: their rows as verifiers formats them, their turn logic, tools and
rubrics; the token layout and masks are posttrain's. The engine writes a scripted turn per prompt and scores it with
a real model's log-probs (tests/rl_core/test_gateway.py's), so the rewards are known by hand and the recorded ids can
be checked against what was "sampled"."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from rl_core.agents.gateway import agent_environment
from rl_core.agents.rollout import EnvironmentFailure, rollout_episodes
from rl_core.agents.verifiers import verifiers_environment, verifiers_rows
from rl_core.rollout import SamplingParams
from rl_core.tasks import Example
from rl_core.tasks.environment import EnvironmentTask
from tests.rl_core.test_agents import stopping_policy, tokenizer
from tests.rl_core.test_gateway import ScriptedEngine, call_text, logp_gap, sampled_runs
from tests.user_code import VERIFIERS_ENVS as ENVS
from tests.user_code import VERIFIERS_PYTHON as PYTHON

pytestmark = pytest.mark.e2e  # each module's first episode starts the verifiers runner, a process


@pytest.fixture(scope="module", autouse=True)
def verifiers_installed():
    assert os.access(PYTHON, os.X_OK), f"{PYTHON}: no verifiers environment; `make verifiers-venv` builds it"


def rows_of(env_id: str, tmp_path, **options) -> list[Example]:
    path = tmp_path / f"{env_id}.jsonl"
    verifiers_rows(env_id, path, python=PYTHON, pythonpath=[ENVS], **options)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [Example("", r.pop("answer"), messages=tuple(r.pop("messages")), columns=r) for r in rows]


def script(prompt: str) -> str:
    """The scripted policy: echo a tool's result; after a hint, guess the number the prompt gave away, else 5; call
    the calculator on a sum, unless told to answer it (then 42 is answered right, any other sum wrong: 999)."""
    if "<tool_response>" in prompt:
        return prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip()
    if prompt.rstrip().endswith(("higher\nassistant:", "lower\nassistant:")):
        return re.search(r"it is (\d)", prompt).group(1)
    if "Guess my number" in prompt:
        return "5"
    expression = re.findall(r"user: (\d+\+\d+)\n", prompt)[-1]
    if "Answer with the sum" in prompt:
        return "42" if expression == "12+30" else "999"
    return call_text(expression)


def play(env_id: str, rows: list[Example], python: str = PYTHON):
    tok = tokenizer()
    model = stopping_policy(tok)
    engine = ScriptedEngine(model, tok, script)
    agent = verifiers_environment(env_id, python=python, pythonpath=[ENVS])
    out, _ = rollout_episodes(engine, EnvironmentTask(agent_environment(agent), agent.__name__), rows, tok, 1,
                              SamplingParams(temperature=1.0, max_tokens=120, seed=3), max_turns=4,
                              max_episode_tokens=600)
    return out, engine, model, tok


def assert_trained_on_the_sampled_ids(out, engine, model) -> None:
    written = {tuple(prompt): ids for prompt, ids in engine.turns}
    for j in range(len(out.episodes)):
        for before, run in sampled_runs(out, j):
            assert written[tuple(before)] == run  # a turn the engine wrote for exactly the ids before it
    assert logp_gap(out, model) <= 1e-5


def test_the_rows_are_the_environments_dataset_as_verifiers_formats_it(tmp_path):
    rows = rows_of("vf_sums", tmp_path, env_args={"n": 2, "system_prompt": "Sum it."})
    assert [list(r.messages) for r in rows] == [
        [{"role": "system", "content": "Sum it."}, {"role": "user", "content": "12+30"}],
        [{"role": "system", "content": "Sum it."}, {"role": "user", "content": "7+8"}]]
    assert [r.answer for r in rows] == ["42", "15"] and [r.columns["example_id"] for r in rows] == [0, 1]
    # an EnvGroup's rows name their environment in `info`, as the group writes them
    mixed = rows_of("vf_mixed", tmp_path)
    assert [json.loads(r.columns["info"])["env_id"] for r in mixed] == ["sums", "sums", "calc", "calc"]


def test_a_single_turn_environment_is_scored_by_its_rubrics_weighted_sum_on_the_ids_the_policy_sampled(tmp_path):
    out, engine, model, _ = play("vf_sums", rows_of("vf_sums", tmp_path, env_args={"n": 2}))
    # "42" is right and brief: 1.0 * 1 + 0.25 * 1; "999" is neither: 0
    assert [r["reward"] for r in out.episodes] == [1.25, 0.0]
    assert [r["completion"] for r in out.episodes] == [[{"role": "assistant", "content": "42"}],
                                                       [{"role": "assistant", "content": "999"}]]
    assert_trained_on_the_sampled_ids(out, engine, model)


def test_a_tool_environment_runs_its_own_tools_and_their_results_are_not_trained_on(tmp_path):
    out, engine, model, tok = play("vf_calc", rows_of("vf_calc", tmp_path))
    assert [r["reward"] for r in out.episodes] == [1.0, 1.0]
    for record, result in zip(out.episodes, ["42", "15"], strict=True):
        assert [m["role"] for m in record["completion"]] == ["assistant", "tool", "assistant"]
        assert record["completion"][0]["tool_calls"][0]["function"]["name"] == "calculator"
        assert record["completion"][1]["content"] == result  # verifiers ran the calculator
        assert record["stats"]["tool_calls"] == 1 and record["stats"]["turns"] == 2
    for j, result in enumerate(["42", "15"]):
        runs = sampled_runs(out, j)
        assert len(runs) == 2 and f"<tool_response>{result}</tool_response>" in tok.decode(runs[1][0])
        assert all("<tool_response>" not in tok.decode(run) for _, run in runs)
    assert_trained_on_the_sampled_ids(out, engine, model)


def test_a_multi_turn_environment_answers_with_env_response_until_its_stop_condition(tmp_path):
    out, engine, model, tok = play("vf_guess", rows_of("vf_guess", tmp_path))
    # found at the first guess (5): 1.0 + 0.5 * 1/1; at the second (7, after "higher"): 1.0 + 0.5 * 1/2
    assert [r["reward"] for r in out.episodes] == [1.5, 1.25]
    assert out.episodes[1]["completion"] == [{"role": "assistant", "content": "5"},
                                             {"role": "user", "content": "higher"},
                                             {"role": "assistant", "content": "7"}]
    runs = sampled_runs(out, 1)
    assert [tok.decode(run) for _, run in runs] == ["5" + tok.eos_token, "7" + tok.eos_token]
    assert "user: higher" in tok.decode(runs[1][0])  # the environment's reply: context, masked
    assert_trained_on_the_sampled_ids(out, engine, model)


def test_an_env_group_routes_each_row_to_its_own_environment_and_rubric(tmp_path):
    out, engine, model, _ = play("vf_mixed", rows_of("vf_mixed", tmp_path))
    # the sums rows by the sums rubric (1.25, 0.0: above), the calculator rows by the calculator's (1.0 each)
    assert [r["reward"] for r in out.episodes] == [1.25, 0.0, 1.0, 1.0]
    assert [len(r["completion"]) for r in out.episodes] == [1, 1, 3, 3]
    assert_trained_on_the_sampled_ids(out, engine, model)


def test_a_python_without_verifiers_and_an_environment_that_does_not_load_are_named(tmp_path):
    # posttrain's own Python has no verifiers (its releases do not install beside posttrain's pins)
    with pytest.raises(RuntimeError, match=r"cannot import verifiers: build its own environment with `make "
                                           r"verifiers-venv`"):
        verifiers_rows("vf_sums", tmp_path / "rows.jsonl", python=sys.executable)
    assert not (tmp_path / "rows.jsonl").exists()
    with pytest.raises(EnvironmentFailure, match=r"cannot import verifiers"):
        play("vf_sums", [Example("", "42", messages=({"role": "user", "content": "12+30"},))],
             python=sys.executable)
    with pytest.raises(EnvironmentFailure, match=r"verifiers environment vf_nowhere: .*vf_nowhere"):
        play("vf_nowhere", [Example("", "42", messages=({"role": "user", "content": "12+30"},))])


def test_make_data_verifiers_writes_the_train_and_eval_rows_and_refuses_bad_arguments(tmp_path, capsys):
    from cli.main import main

    out = tmp_path / "rows"
    assert main(["make-data", "verifiers", "--env", "vf_sums", "--env-args", '{"n": 3}', "--out", str(out),
                 "--val-n", "2", "--python", PYTHON, "--pythonpath", str(ENVS)]) == 0
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in train] == ["42", "15", "3"] and [r["answer"] for r in val] == ["42", "15"]
    assert main(["make-data", "verifiers", "--env", "vf_sums", "--env-args", "[3]", "--out", str(out)]) == 2
    assert "--env-args '[3]' is not a JSON object" in capsys.readouterr().err
    assert main(["make-data", "verifiers", "--env", "vf_nowhere", "--out", str(tmp_path / "none"), "--python", PYTHON,
                 "--pythonpath", str(ENVS)]) == 1
    assert "the train rows of verifiers environment vf_nowhere could not be read" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_validate_loads_the_environment_in_verifiers_python_and_names_what_stops_it():
    from rl_core.preflight.rows import first_episode_problem

    row = Example("", "42", messages=({"role": "user", "content": "12+30"},))

    def problem(env_id: str, python: str = PYTHON) -> str | None:
        agent = verifiers_environment(env_id, python=python, pythonpath=[ENVS])
        return first_episode_problem(agent_environment(agent), row)

    assert problem("vf_calc") is None
    assert re.match(r"verifiers environment vf_nowhere does not load: .*vf_nowhere", problem("vf_nowhere"))
    assert "cannot import verifiers: build its own environment with `make verifiers-venv`" in problem(
        "vf_calc", python=sys.executable)
