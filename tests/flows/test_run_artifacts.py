"""The training flow run's Prefect artifacts (flows/artifacts.py) without a flow: the MLflow link, the keys, the
summary's text, and a Prefect API that cannot be reached (the run goes on). The artifacts of real flow runs:
tests/flows/test_flow.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest


def test_the_mlflow_link_is_for_a_server_only_and_never_carries_credentials():
    from infra.tracking.items import server_run_url as _mlflow_run_url

    assert _mlflow_run_url("http://127.0.0.1:5000", "3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc"
    assert _mlflow_run_url("https://me:s3cret@mlflow.example.org/base/", "3", "abc") == \
        "https://mlflow.example.org/base/#/experiments/3/runs/abc"
    assert _mlflow_run_url("http://[::1]:5000", "1", "r") == "http://[::1]:5000/#/experiments/1/runs/r"
    for local in ("sqlite:////tmp/mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns", "databricks", None):
        assert _mlflow_run_url(local, "1", "r") is None


def test_artifact_keys_are_what_the_api_accepts():
    from flows.artifacts import artifact_key

    assert artifact_key("gspo-gsm8k") == "gspo-gsm8k"
    assert artifact_key("My_Run.v2 (test)") == "my-run-v2-test"
    assert artifact_key("___") == "run"


def test_the_summary_names_steps_reward_accuracy_and_where_things_are(tmp_path):
    from flows.artifacts import summary_markdown

    records = [{"step": 0, "val/accuracy": 0.1}, {"step": 1, "rollout/reward_mean": 0.25},
               {"step": 2, "rollout/reward_mean": 0.5, "val/accuracy": 0.4}]
    text = summary_markdown("arith", records, step=2, total=2, run_dir=tmp_path / "runs" / "arith",
                            checkpoint=tmp_path / "runs" / "arith" / "checkpoints" / "step_00000002",
                            model_dir="/m/final_model", mlflow_run_id="r1", mlflow_url=None,
                            tracking_uri="sqlite:////x/mlflow.db")
    assert text.startswith("# arith\n")
    for row in ("| steps | 2 of 2 |", "| final reward (rollout/reward_mean) | 0.5000 (step 2) |",
                "| held-out accuracy (val/accuracy) | 0.1000 (step 0) → 0.4000 (step 2) |",
                f"| run directory | `{tmp_path / 'runs' / 'arith'}` |", "| final model | `/m/final_model` |",
                "| MLflow run | `r1` in `sqlite:////x/mlflow.db` |"):
        assert row in text, (row, text)
    dpo = summary_markdown("pairs", [{"step": 1, "train/reward_accuracy": 0.75}], step=1, total=4, run_dir=Path("r"),
                           checkpoint=None, model_dir=None, mlflow_run_id="r2", mlflow_url="http://h/#/x",
                           tracking_uri="http://h")
    assert "| final preference accuracy (train/reward_accuracy) | 0.7500 (step 1) |" in dpo
    assert "| newest checkpoint | none (rl.save_every=0) |" in dpo and "| MLflow run | [r2](http://h/#/x) |" in dpo


def test_the_summary_and_the_end_of_run_line_name_the_reward_that_decides_accuracy(tmp_path):
    from cli.main import summary_line
    from flows.artifacts import summary_markdown
    from infra.tracking.tracker import MetricsLog

    records = [{"step": 0, "val/accuracy": 0.05, "val/mean_reward": 0.3},
               {"step": 4, "rollout/reward_mean": 0.9, "val/accuracy": 0.5, "val/mean_reward": 0.7}]
    text = summary_markdown("trl", records, step=4, total=4, run_dir=tmp_path, checkpoint=None, model_dir=None,
                            mlflow_run_id="r1", mlflow_url=None, tracking_uri="sqlite:////x/mlflow.db",
                            success_reward="accuracy_reward")
    rows = [line for line in text.splitlines() if line.startswith(("| held-out", "| correct"))]
    assert rows == ["| held-out accuracy (val/accuracy) | 0.0500 (step 0) → 0.5000 (step 4) |",
                    "| correct when | reward `accuracy_reward` ≥ 1 (data.success_reward) |"]
    without = summary_markdown("trl", [{"step": 4, "rollout/reward_mean": 0.9}], step=4, total=4, run_dir=tmp_path, checkpoint=None,
                               model_dir=None, mlflow_run_id=None, mlflow_url=None, tracking_uri=None,
                               success_reward="accuracy_reward")
    assert "correct when" not in without  # nothing evaluated: nothing to qualify

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for record in records:
        log.append(record)
    result = {"metrics": str(log.path), "run_dir": str(tmp_path), "mlflow_run_id": "r1",
              "success_reward": "accuracy_reward"}
    assert summary_line(result).startswith("held-out accuracy (accuracy_reward >= 1) 0.050 (step 0) -> 0.500 (step 4); ")


def test_the_completions_artifact_shows_the_rows_data_columns_and_each_rewards_value():
    from flows.artifacts import completions_markdown

    rows = [{"step": 3, "attempt": 1, "prompt": "What is 2+2?", "solution": "4", "difficulty": 1, "completion": "4",
             "reward": 1.2, "accuracy_reward": 1.0, "format_reward": 1.0, "finish_reason": "stop"}]
    text = completions_markdown(3, rows)
    section = text.split("## 1. reward 1.2000, finish reason stop\n\n", 1)[1]
    assert section == ("**prompt** What is 2+2?\n\n**solution** 4\n\n**difficulty** 1\n\n**accuracy_reward** 1.0\n\n"
                       "**format_reward** 1.0\n\n```\n4\n```\n")


@pytest.mark.filterwarnings("ignore:Artifact creation outside of a flow:FutureWarning")
def test_an_unreachable_prefect_api_costs_one_warning_and_no_failure(caplog):
    """A real client against a port nothing listens on: the first artifact call fails, is logged, and switches the
    artifacts off, so no later step waits on the API again."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from flows.artifacts import RunArtifacts
    from infra.processes import free_port

    artifacts = RunArtifacts("offline", 10)
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}), \
            caplog.at_level(logging.WARNING, logger="posttrain"):
        artifacts.start(None, "r", 0)
        artifacts.step(1)
        artifacts.summary([], step=1, run_dir=Path("r"), checkpoint=None, model_dir=None, mlflow_run_id="r",
                          tracking_uri=None)
    assert artifacts.off and artifacts.progress_id is None
    warnings = [r.getMessage() for r in caplog.records if "Prefect artifacts" in r.getMessage()]
    assert len(warnings) == 1 and "create_progress_artifact failed" in warnings[0], warnings


def test_the_completions_artifact_shows_each_sample_whole_fenced_cut_and_redacted():
    from flows.artifacts import COMPLETION_CHARS, completions_markdown

    conversation = "assistant: <tool_call>{\"name\": \"calculator\"}</tool_call>\ntool: ```1368```\nassistant: 1368"
    rows = [{"prompt": "123+456+789", "answer": "1368", "completion": conversation, "reward": 1.0, "finish_reason": "stop"},
            {"prompt": "fetch https://me:s3cret@h.example/x", "answer": "2", "completion": "x" * (COMPLETION_CHARS + 5),
             "reward": None, "finish_reason": "length"}]
    text = completions_markdown(7, rows)
    assert text.startswith("# Sample completions, step 7\n")
    assert "## 1. reward 1.0000, finish reason stop" in text and "## 2. reward none, finish reason length" in text
    # the conversation whole, in a fence longer than the backticks inside it
    assert f"````\n{conversation}\n````" in text
    assert "x" * COMPLETION_CHARS + "\n... (5 more characters)\n```" in text
    assert "s3cret" not in text and "**prompt** fetch https://" in text  # a credential in a URI is redacted
