"""An agent task end to end (recipes/guess_number.py, docs/agents.md): the GRPO flow plays the environment's games
turn by turn on the rollout engine, trains on the policy's guesses only, logs the episodes' counts and whole
conversations, and scores the held-out split by playing it greedily.

The policy is the random-init tiny model with its end-of-turn logit raised, so that its turns stop after a few
tokens and the games run several turns (the warm start's two-digit answers would end every game at once)."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from tests.conftest import recipe
from tests.run_helpers import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def talkative_model(workdir, out):
    """The tiny init model with its <eos> logit lifted to 4x its second hidden unit: short turns that stop."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(workdir / "artifacts" / "tiny-model" / "init", out)
    weights = load_file(out / "model.safetensors")
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    head = weights["lm_head.weight"]
    head[eos] = 0.0
    head[eos, 1] = 4.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_guess_number_plays_multi_turn_games_trains_on_guesses_only_and_logs_the_conversations(in_workdir, tmp_path):
    from examples.guess_number import main as build_data
    from flows.grpo import grpo

    build_data(["--out", "data/guess-number", "--seed", "0"])  # the `guess_number` DVC stage's command
    model = talkative_model(in_workdir, tmp_path / "talkative")
    state = grpo(recipe("guess_number"), [f"model.name_or_path={model}", "rollout.prompts_per_step=4", "rollout.n=4",
                                  "rollout.max_tokens=4", "rl.max_steps=2", "rl.save_every=2",
                                  "rl.validation.max_prompts=8", "rl.validation.every_steps=2",
                                  "tracking.sample_completions_every=1", "tracking.system_metrics=false",
                                  "data.reward_workers=1", "job.name=guess",
                                  f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"], return_state=True)
    run = in_workdir / "runs" / "guess"
    records = read_metrics(run)
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1.0 <= r["rollout/turns_mean"] <= 4.0 and r["rollout/turns_max"] >= 2  # several turns a game
        assert r["rollout/env_reward_mean"] == pytest.approx(r["rollout/rewards/environment/mean"])
        # the environment's reward plus the recipe's conversation reward, weighted 0.3
        heeds = r["rollout/rewards/heeds_replies/mean"]
        assert r["rollout/reward_mean"] == pytest.approx(r["rollout/env_reward_mean"] + 0.3 * heeds, abs=1e-6)
        assert r["rollout/tool_calls_mean"] == 0.0 and r["rollout/env_errors"] == 0.0
        assert r["perf/env_s"] > 0
        # the trainer's log-probs of the episodes' ids equal the sampler's (HF in float32)
        assert r["rollout/logp_abs_diff_max"] <= 1e-5
        # loss on the guesses only: at most 4 tokens a turn, 4 turns, although each game holds far more tokens
        assert r["rollout/response_len_max"] <= 4 * 4
    assert [r["step"] for r in records if "val/accuracy" in r] == [0, 2]
    # the completions table holds whole games: a guess, the environment's reply, the next guess
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (found,) = client.search_runs(client.get_experiment_by_name("posttrain").experiment_id)
    run_id = found.info.run_id
    table = pd.read_json(client.download_artifacts(run_id, "completions.json", str(tmp_path)), orient="split")
    games = [t for t in table["completion"] if "\nuser: " in t]
    assert games and all(t.startswith("assistant: ") for t in table["completion"])
    assert any(hint in t for t in games for hint in ("user: higher: ", "user: lower: ", "user: a number from 1 to 6"))
    # the Prefect run shows them too: the last step's sample, each game whole
    from tests.flows.test_flow import flow_run_artifacts

    shown = [a.data for a in flow_run_artifacts(state.state_details.flow_run_id) if a.key == "guess-completions"]
    assert sorted(text.splitlines()[0] for text in shown) == ["# Sample completions, step 1",
                                                             "# Sample completions, step 2"]  # a version per step
    (shown,) = [text for text in shown if text.startswith("# Sample completions, step 2")]
    last = table[table["step"] == 2]
    assert len(last) == 8
    assert all(f"```\n{conversation}\n```" in shown for conversation in last["completion"])
    assert next((run / "final_model").glob("*.safetensors")).stat().st_size > 0
