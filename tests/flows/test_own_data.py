"""The own-data example end to end (recipes/own_data_lora.py, docs/data.md): chat-format JSONL rows built by the
DVC stage's command, two weighted TRL-style rewards in the reward pool, a LoRA adapter trained and saved; then a
bad row in the data refuses the run before anything is placed, keeping what the first run saved."""

from __future__ import annotations

import json

import pytest

from tests.conftest import recipe
from tests.run_helpers import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHORT = ["model.name_or_path=artifacts/tiny-model/init", "rollout.prompts_per_step=4", "rollout.n=4",
         "rl.max_steps=2", "rl.save_every=2", "rl.validation.max_prompts=8", "rl.validation.every_steps=2",
         "job.name=own"]


def test_own_data_trains_lora_with_weighted_rewards_and_a_bad_row_loses_nothing(in_workdir):
    from examples.own_data import main as build_data
    from flows.grpo import grpo
    from rl_core.config import ConfigError

    build_data(["--out", "data/own-data", "--seed", "0"])  # the `own_data` DVC stage's command
    grpo(recipe("own_data_lora"), SHORT)
    run = in_workdir / "runs" / "own"
    steps = [r for r in read_metrics(run) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # both functions score every completion: the mean reward is the weighted sum of their means
        digits, length = r["rollout/rewards/answer_digits/mean"], r["rollout/rewards/within_length/mean"]
        assert 0 <= digits <= 1 and 0 <= length <= 1
        assert r["rollout/reward_mean"] == pytest.approx(0.8 * digits + 0.2 * length, abs=1e-6)  # float32 batch
    # the completions table of the last step: the rows' data columns by name, each reward's own value beside the total
    import mlflow

    from infra.tracking.tracker import resolve_experiment, resolve_tracking_uri
    from rl_core.config import load_config

    cfg = load_config(recipe("own_data_lora"), SHORT)
    client = mlflow.MlflowClient(resolve_tracking_uri(cfg))
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name(resolve_experiment(cfg)).experiment_id],
                                       filter_string="attributes.run_name = 'own'")
    table = client.load_table(mlflow_run.info.experiment_id, "completions.json", run_ids=[mlflow_run.info.run_id])
    assert list(table.columns) == ["step", "attempt", "prompt", "answer", "max_chars", "completion", "reward",
                                   "answer_digits", "within_length", "finish_reason"]
    assert set(table["step"]) == {2} and len(table) == 8  # tracking.sample_completions of the last step's 16
    for _, row in table.iterrows():
        assert 0 <= row["answer_digits"] <= 1 and row["within_length"] in (0.0, 1.0)
        assert row["reward"] == pytest.approx(0.8 * row["answer_digits"] + 0.2 * row["within_length"], abs=1e-6)
    adapter = json.loads((run / "final_model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())

    bad = in_workdir / "data" / "own-data" / "bad-val.jsonl"
    rows = (in_workdir / "data" / "own-data" / "val.jsonl").read_text().splitlines()
    rows[4] = json.dumps({"messages": [{"role": "user", "content": "  "}], "answer": "1", "max_chars": 1})
    bad.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match=r"data\.val=.*bad-val\.jsonl:5: column 'messages': the last user "
                                          r"message is empty"):
        grpo(recipe("own_data_lora"), [*SHORT, "rl.max_steps=4", f"data.val={bad}"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == saved
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2]
