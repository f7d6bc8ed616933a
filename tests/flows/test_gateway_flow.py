"""An agent function end to end (recipes/tool_arithmetic_agent.py, docs/agents.md "Bring your own agent"): the GRPO
flow runs the agent, written with the plain `openai` client, in the environment actors; its requests reach the
gateway in the same actor and are sampled on the rollout engine as episodes' turns; the trainer reads the sampler's
log-probs on exactly those ids, and the held-out split is scored by the same agent, greedily. The agent here
(`tests.user_code:compacting_agent`) asks its second turn in a conversation that does not extend the first, so its
episodes train as two samples each, in a batch whose rows vary, filled to the micro-batches' split."""

from __future__ import annotations

import pytest

from tests.conftest import recipe
from tests.flows.test_agents_flow import talkative_model
from tests.run_helpers import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_an_agent_function_trains_through_the_gateway_in_the_environment_actors_with_new_samples(in_workdir, tmp_path):
    from examples.tool_arithmetic import TEMPLATE
    from examples.tool_arithmetic import main as build_data
    from flows.grpo import grpo

    build_data(["--out", "data/tool-arithmetic", "--seed", "0"])  # the `tool_arithmetic` DVC stage's command
    model = talkative_model(in_workdir, tmp_path / "talkative")
    (model / "chat_template.jinja").write_text(TEMPLATE)
    grpo(recipe("tool_arithmetic_agent"), [
        f"model.name_or_path={model}", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=8",
        "rl.max_steps=2", "rl.save_every=2", "rl.validation.max_prompts=4", "rl.validation.every_steps=2",
        "data.task=tests.user_code:compacting_agent", "rl.micro_batch_per_replica=2",
        "data.env_workers=1", "data.reward_workers=0", "tracking.system_metrics=false",
        "tracking.sample_completions_every=0", "tracking.trace_episodes=2", "job.name=agent-fn",
        f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    records = read_metrics(in_workdir / "runs" / "agent-fn")
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # every episode got its answer: a turn that stopped, answered to the agent, which then ended the episode
        assert r["rollout/turns_mean"] >= 1.0 and r["rollout/env_errors"] == 0.0
        assert r["rollout/new_samples"] >= 1.0  # trained beside their episodes' rows, each with its own mask
        assert r["rollout/unstarted_episodes"] == 0.0
        assert r["rollout/logp_abs_diff_max"] <= 1e-5  # the trainer reads the sampler's ids as sampled
        assert r["rollout/response_len_max"] <= 8 * 3
    assert [r["step"] for r in records if "val/accuracy" in r] == [0, 2]
    # two episodes a step as MLflow traces of the run, a span per turn
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (found,) = client.search_runs(client.get_experiment_by_name("posttrain").experiment_id)
    traces = client.search_traces(locations=[found.info.experiment_id], run_id=found.info.run_id)
    assert sorted(t.info.tags["posttrain.step"] for t in traces) == ["1", "1", "2", "2"]
    for trace in traces:
        names = [span.name for span in trace.data.spans]
        assert names[0] == "episode" and "turn 1" in names


def test_a_verifiers_environment_trains_in_the_environment_actors(in_workdir, tmp_path):
    """A MultiTurnEnv written with verifiers (tests/fixtures/verifiers_envs/vf_guess.py) runs in its own Python,
    started by the environment actor, against the actor's gateway: its `env_response` answers each guess until its
    stop condition or the turn limit, and its rubric's weighted sum is the episode's reward."""
    from examples.tool_arithmetic import TEMPLATE
    from flows.grpo import grpo
    from rl_core.agents.verifiers import verifiers_rows
    from tests.user_code import VERIFIERS_ENVS, VERIFIERS_PYTHON

    for split in ("train", "val"):  # vf_guess's two rows, for both splits
        assert verifiers_rows("vf_guess", f"data/vf-guess/{split}.jsonl", python=VERIFIERS_PYTHON,
                              pythonpath=[VERIFIERS_ENVS]) == 2
    model = talkative_model(in_workdir, tmp_path / "talkative")
    (model / "chat_template.jinja").write_text(TEMPLATE)
    grpo(recipe("tool_arithmetic_agent"), [
        f"model.name_or_path={model}", "data.task=tests.user_code:vf_guess", "data.train=data/vf-guess/train.jsonl",
        "data.val=data/vf-guess/val.jsonl", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=8",
        "rollout.max_turns=4", "rl.max_steps=2", "rl.save_every=0", "rl.validation.max_prompts=2",
        "rl.validation.every_steps=2", "data.env_workers=1", "data.reward_workers=0", "tracking.system_metrics=false",
        "tracking.sample_completions_every=0", "job.name=vf-guess", f"tracking.mlflow_uri=sqlite:///{tmp_path / 'm.db'}"])
    steps = [r for r in read_metrics(in_workdir / "runs" / "vf-guess") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/env_errors"] == 0.0 and r["rollout/unstarted_episodes"] == 0.0
        assert r["rollout/logp_abs_diff_max"] <= 1e-5
        # every episode's reward is the rubric's found + 0.5 / turns: at least 0.5 / 4 whatever the guesses
        assert r["rollout/reward_mean"] >= 0.125 - 1e-9
        assert 1.0 <= r["rollout/turns_mean"] <= 4.0
    assert max(r["rollout/turns_max"] for r in steps) >= 2  # a guess answered by env_response, then another
