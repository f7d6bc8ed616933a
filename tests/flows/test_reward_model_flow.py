"""The RLHF loop end to end on CPU (real Prefect, local Ray, MLflow on SQLite): a reward model trained on preference
pairs (no engines, no reference), exported as a sequence classifier; then GRPO with that model as its reward, its
replica placed beside the trainer rank, the rule reward at weight 0 deciding accuracy, a local generative judge beside
it, and the hacking check."""

from __future__ import annotations

import json

import pytest

from tests.conftest import LEAN, recipe
from tests.run_helpers import phase, read_metrics, task_runs


@pytest.mark.e2e
@pytest.mark.slow
def test_a_reward_model_trains_exports_and_rewards_a_grpo_run(cwd, warm_model):
    import torch
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flows.dpo import dpo
    from flows.grpo import grpo
    from infra.checkpoints.export import export_checkpoint
    from rl_core.algorithms.reward_model import sequence_scores
    from rl_core.config import load_config
    from rl_core.data.pair_building import make_arithmetic_pairs
    from rl_core.data.preferences import load_preference_pairs, pairs_to_trajectory
    from rl_core.evaluation.heldout import evaluate_accuracy
    from rl_core.model.loading import load_policy
    from rl_core.tasks import load_examples
    from tests.builders import STARTUP_TIMEOUT_S

    pairs = cwd / "data" / "rm-pairs"
    make_arithmetic_pairs(cwd / "data/arithmetic/train.jsonl", pairs / "train.jsonl", seed=0, max_pairs=64)
    make_arithmetic_pairs(cwd / "data/arithmetic/val.jsonl", pairs / "val.jsonl", seed=0, max_pairs=16)
    warm = str(warm_model[0])
    rm_run = [f"model.name_or_path={warm}", f"data.train={pairs / 'train.jsonl'}", f"data.val={pairs / 'val.jsonl'}",
              "rollout.prompts_per_step=8", "rl.max_steps=4", "rl.validation.every_steps=2", "rl.save_every=2", *LEAN]
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        state = dpo(recipe("rm_arithmetic"), rm_run, return_state=True)
    assert state.is_completed(), state.message
    names = {phase(r.name) for r in task_runs(state.state_details.flow_run_id)}
    assert "sync" not in names and "evaluate" not in names and "evaluate_pairs" in names  # no engine to sample
    run_dir = cwd / "runs" / "rm-arithmetic"
    records = read_metrics(run_dir)
    assert records[0]["val/accuracy"] == 0.5 and records[0]["val/loss"] == pytest.approx(0.6931, abs=1e-4)  # head 0
    final = next(r for r in records if r["step"] == 4 and "val/accuracy" in r)
    assert final["train/loss"] < records[1]["train/loss"] + 0.05
    assert json.loads((run_dir / "placement.json").read_text())["engines"] == []
    # the export: a sequence classifier whose scores of the held-out pairs give the logged accuracy and loss
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final_model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_model")
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    batch = pairs_to_trajectory(load_preference_pairs(pairs / "val.jsonl"), tokenizer)
    with torch.no_grad():
        scores = sequence_scores(model, batch.input_ids, batch.attention_mask)
    w, lose = scores[0::2], scores[1::2]
    assert float((w > lose).double().mean()) == pytest.approx(final["val/accuracy"], abs=1e-9)
    assert float(torch.nn.functional.softplus(lose - w).mean()) == pytest.approx(final["val/loss"], abs=1e-5)
    # the step-4 checkpoint exports as the same sequence classifier
    done = export_checkpoint(run_dir, step=4)
    exported, saved = load_file(done.path / "model.safetensors"), load_file(run_dir / "final_model/model.safetensors")
    assert set(exported) == set(saved) and all(exported[k].equal(saved[k]) for k in saved)

    # GRPO rewarded by the reward model alone; the exact-match reward (weight 0) decides val/accuracy
    # and a local judge (the warm model, asked to continue "<sum><answer>="; weight 0) beside it
    rewards = ("data.rewards=[{model: runs/rm-arithmetic, name: rm}, {path: 'rl_core.rewards.arithmetic:exact_match', "
               f"weight: 0.0, name: arithmetic}}, {{judge: {{model: '{warm}', max_tokens: 3, template: "
               "'{prompt}{completion}='}, weight: 0.0, name: j}]")
    rl_run = [f"model.name_or_path={warm}", "rollout.prompts_per_step=4", "rollout.n=4", "rl.max_steps=2",
              "rl.validation.max_prompts=16", "rl.validation.every_steps=1", "rl.save_every=0", rewards, *LEAN]
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        state = grpo(recipe("rlhf_arithmetic"), rl_run, return_state=True)
    assert state.is_completed(), state.message
    rl_dir = cwd / "runs" / "rlhf-arithmetic"
    placed = json.loads((rl_dir / "placement.json").read_text())
    assert len(placed["reward_models"]) == 1 and placed["reward_models"][0]["node_id"] == placed["trainers"][0]["node_id"]
    steps = read_metrics(rl_dir)
    trained = [r for r in steps if r["step"] > 0 and "rollout/rewards/rm/mean" in r]
    assert len(trained) == 2 and all("rollout/rewards/arithmetic/mean" in r for r in trained)
    assert all(r["rollout/reward_mean"] == pytest.approx(r["rollout/rewards/rm/mean"], abs=1e-6) for r in trained)
    for r in trained:  # the judge's counts beside its mean (fractions of the batch)
        assert 0 <= r["rollout/rewards/j/unparsable"] <= 1 and r["rollout/rewards/j/failed"] == 0
        assert "rollout/rewards/j/mean" in r and 0 <= r["rollout/rewards/j/cached"] <= 1
    evals = [r for r in steps if "val/accuracy" in r]
    assert next(r["val/reward_hacking"] for r in evals) == 0.0 and all(r["val/reward_hacking"] in (0.0, 1.0)
                                                                       for r in evals)
    # step 0's held-out reward is the reward model's mean score of the initial policy's greedy answers, as this
    # process scores them (the entry loaded here, one by one)
    cfg = load_config(str(rl_dir / "config_resolved.yaml"))
    policy, tok = load_policy(cfg.model)
    here = evaluate_accuracy(policy, tok, load_examples(cfg.data.val, "arithmetic")[:16], data=cfg.data,
                             max_tokens=cfg.rollout.max_tokens)
    before = next(r for r in evals if r["step"] == 0)
    assert before["val/mean_reward"] == pytest.approx(here["mean_reward"], abs=1e-4)
    assert before["val/accuracy"] == pytest.approx(here["accuracy"], abs=1e-9)
