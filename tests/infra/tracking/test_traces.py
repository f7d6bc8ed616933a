"""Agent episodes as MLflow traces (infra.tracking.traces): written to a local SQLite store and read back with
MLflow's own API, span by span."""

from __future__ import annotations

import json

import pytest

from infra.tracking.traces import log_episode_traces
from tests.conftest import migrated_mlflow_db


def record(row: int, answer: str, error: str | None = None) -> dict:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    return {"prompt": [{"role": "user", "content": f"sum {row}"}],
            "completion": [{"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "name": "calculator", "content": "3"},
                           {"role": "user", "content": "and now?"},
                           {"role": "assistant", "content": answer}],
            "reward": 1.0, "error": error,
            "stats": {"turns": 2, "tokens": 40, "sampled_tokens": 17, "turn_tokens": [12, 5], "truncated": False}}


@pytest.mark.e2e  # MLflow's trace context runs `git version`
def test_sampled_episodes_are_traces_of_the_run_with_a_span_per_turn_and_tool_call(tmp_path):
    from mlflow import MlflowClient

    uri = "sqlite:///" + str(migrated_mlflow_db(tmp_path))
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("agents", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment).info.run_id
    records = [record(j, str(j)) for j in range(5)]
    # row 0 went on in a new sample after its second of three turns: its first assistant message is the one the
    # agent sent again (no sampled tokens of its own in the trace), its last is the last sample's own turn
    records[0]["stats"].update(turns=3, turn_tokens=[12, 9, 5], samples=2, last_sample_turns=1)
    ids = log_episode_traces(client, uri, experiment, run, 7, records, [0.1 * j for j in range(5)], 2,
                             policy_version=6)
    assert len(ids) == 2
    traces = client.search_traces(locations=[experiment], run_id=run)
    assert sorted(t.info.trace_id for t in traces) == sorted(ids)
    by_row = {}
    for trace in traces:
        root = next(s for s in trace.data.spans if s.parent_id is None)
        by_row[root.attributes["posttrain.row"]] = trace
        assert trace.info.tags["posttrain.step"] == "7"
        assert root.attributes["posttrain.policy_version"] == 6
        assert root.attributes["posttrain.turns"] == (3 if root.attributes["posttrain.row"] == 0 else 2)
    assert sorted(by_row) == [0, 4]  # spread over the step: the first and the last episode
    trace = by_row[4]
    spans = {s.name: s for s in trace.data.spans}
    assert set(spans) == {"episode", "turn 1", "tool calculator", "environment", "turn 2"}
    root = spans["episode"]
    assert root.attributes["posttrain.reward"] == 0.4 and root.outputs["reward"] == 0.4
    assert root.inputs == {"messages": [{"role": "user", "content": "sum 4"}]}
    assert spans["turn 1"].parent_id == root.span_id and spans["turn 1"].attributes["posttrain.sampled_tokens"] == 12
    assert spans["turn 2"].outputs["message"]["content"] == "4" and spans["turn 2"].attributes["posttrain.sampled_tokens"] == 5
    tool = spans["tool calculator"]
    assert tool.parent_id == spans["turn 1"].span_id
    assert tool.inputs == {"arguments": {"expression": "1+2"}} and tool.outputs == {"content": "3"}
    assert spans["environment"].outputs["message"] == {"role": "user", "content": "and now?"}
    assert json.loads(json.dumps(trace.to_dict()))  # the whole trace reads back as JSON
    split = {s.name: s for s in by_row[0].data.spans}
    assert "posttrain.sampled_tokens" not in split["turn 1"].attributes
    assert split["turn 2"].attributes["posttrain.sampled_tokens"] == 5
