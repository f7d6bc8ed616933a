"""PPO with a critic end to end on CPU (real Prefect, local Ray, MLflow on SQLite): the values phase each step, the
critic's warm-up, its checkpoint and bitwise resume beside the policy, its export as a model of its own; and a run
with rl.async_steps on a separate engine, whose batches reach the critic and the policy a version late."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from tests.conftest import LEAN, recipe
from tests.run_helpers import assert_same_math, phase, read_metrics, task_runs

# the warm start (rewards spread), one completion per prompt, two mini-batches a step (the critic's too), and a KL
# penalty in the reward against another model, so the reference's scores reach GAE
PPO_RUN = ["rollout.prompts_per_step=8", "rl.mini_batch_per_replica=4", "rl.validation.max_prompts=16",
           "rl.validation.every_steps=0", "rl.validation.before_training=false", "rl.objective.critic_warmup_steps=1",
           "rl.objective.kl_reward_coef=0.05", "rl.reference=artifacts/tiny-model/ref", "rl.objective.critic_lr=1e-3",
           "rl.save_every=2", "rl.max_steps=4", "job.name=ppo", *LEAN]


@pytest.mark.e2e
@pytest.mark.slow
def test_ppo_trains_a_critic_then_the_policy_and_resumes_both_bitwise(cwd, warm_model):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    from flows.grpo import grpo
    from infra.checkpoints.shards import full_tensors
    from infra.checkpoints.store import CheckpointStore
    from tests.builders import STARTUP_TIMEOUT_S

    overrides = [f"model.name_or_path={warm_model[0]}", *PPO_RUN]
    run_dir = cwd / "runs" / "ppo"
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        state = grpo(recipe("ppo_arithmetic"), overrides, return_state=True)
    assert state.is_completed(), state.message
    names = Counter(phase(r.name) for r in task_runs(state.state_details.flow_run_id))
    assert names["values"] == names["train"] == 4
    straight = read_metrics(run_dir)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    # the warm-up: step 1 trains the critic alone, and the policy's weights are those the engines sampled step 2 with
    assert "critic/loss" in straight[0] and "train/loss" not in straight[0]
    assert all("train/loss" in r and "critic/loss" in r for r in straight[1:])
    assert straight[0]["critic/values_mean"] == 0 and straight[1]["critic/values_mean"] != 0  # the head starts at 0
    assert all(r["rollout/kl_reward"] != 0 for r in straight[1:])  # the policy left the reference: KL in the reward
    policy = load_file(run_dir / "final_model" / "model.safetensors")
    critic = load_file(run_dir / "final_model" / "critic" / "model.safetensors")
    exported = AutoModelForTokenClassification.from_pretrained(run_dir / "final_model" / "critic")
    assert exported.config.num_labels == 1 and critic["score.weight"].abs().sum() > 0
    saved = full_tensors(run_dir / "checkpoints" / "step_00000004", prefix="critic.model")
    assert saved and all(saved[k].equal(critic[k]) for k in saved)

    store = CheckpointStore(run_dir / "checkpoints")
    shutil.rmtree(store.path_for(4))  # a crash after step 2's checkpoint
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        assert grpo(recipe("ppo_arithmetic"), overrides, return_state=True).is_completed()
    resumed = read_metrics(run_dir)
    assert_same_math(resumed, straight)  # the critic's values, GAE and both losses again, bit for bit
    again = load_file(run_dir / "final_model" / "model.safetensors")
    assert all(policy[k].equal(again[k]) for k in policy)
    again = load_file(run_dir / "final_model" / "critic" / "model.safetensors")
    assert all(critic[k].equal(again[k]) for k in critic)


@pytest.mark.e2e
@pytest.mark.slow
def test_ppo_trains_asynchronously_on_a_separate_engine(cwd, warm_model):
    """rl.async_steps=1: step s trains the batch sampled while step s - 1 trained, one version behind; the critic
    scores it as it arrives and the policy's ratio is against its sampler."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.grpo import grpo
    from tests.builders import STARTUP_TIMEOUT_S

    overrides = [f"model.name_or_path={warm_model[0]}", *PPO_RUN, "job.name=ppo-async", "rl.max_steps=3",
                 "rl.save_every=0", "cluster.placement=separate", "rollout.num_engines=1", "rl.async_steps=1"]
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: STARTUP_TIMEOUT_S}):
        assert grpo(recipe("ppo_arithmetic"), overrides, return_state=True).is_completed()
    records = read_metrics(cwd / "runs" / "ppo-async")
    assert [r["step"] for r in records] == [1, 2, 3] and all("critic/loss" in r for r in records)
    assert records[0]["rollout/policy_staleness"] == 0 and all(r["rollout/policy_staleness"] == 1 for r in records[1:])
    # step 3's batch was sampled before step 2's update (step 1 was the critic's warm-up): the ratio moved off 1
    assert abs(records[2]["train/ratio_mean"] - 1) > 1e-4 and records[2]["rollout/logp_abs_diff"] > 1e-4
