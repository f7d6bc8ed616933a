"""The GRPO flow end to end on CPU: real Prefect (ephemeral API), real local Ray, MLflow on SQLite."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, recipe
from tests.faults import fail_first, faulty_reward_task
from tests.run_helpers import phase, read_metrics, task_runs

PHASES = ("rollout", "reward", "annotate", "validate", "train", "sync")


def flow_run_artifacts(flow_run_id) -> list:
    """The artifacts of a flow run, as the API holds them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))


@pytest.fixture(scope="module")
def faulty_run(workdir):
    """One short run with an injected failure in rollout and in reward (each fails once, then retries)."""
    import flows.on_policy
    from flows.grpo import grpo
    from infra.workers.engines import EnginePool

    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EnginePool, "generate", fail_first(EnginePool.generate, 1, "rollout"))
            patch.setattr(flows.on_policy, "reward_task", faulty_reward_task(fail=1))
            state = grpo(recipe("arithmetic"), [*FAST, "job.name=faulty", "rl.max_steps=3", "rl.save_every=2",
                                                "job.retry_delay_s=0", "rl.validation.before_training=false"],
                         return_state=True)
    finally:
        os.chdir(cwd)
    return state, workdir / "runs" / "faulty"


@pytest.mark.e2e
def test_flow_completes_with_every_phase_per_step(faulty_run):
    state, _ = faulty_run
    assert state.is_completed(), state.message
    runs = task_runs(state.state_details.flow_run_id)
    names = Counter(phase(r.name) for r in runs)
    for name in PHASES:
        assert names[name] == 3, f"{name}: {names[name]} task runs for 3 steps"
    assert names["evaluate"] == 2  # step 2 (every_steps) and the final step 3
    assert names["checkpoint"] == 2  # step 2 (save_every) and the final step 3
    # each task run is named after its phase and step (the retried ones keep one run, and their name)
    by_step = {r.name for r in runs}
    assert {f"{name} step {s}" for name in PHASES for s in (1, 2, 3)} <= by_step
    assert {"evaluate step 2", "evaluate step 3", "checkpoint step 2", "checkpoint step 3",
            "commit_checkpoint step 2", "commit_checkpoint step 3"} <= by_step


@pytest.mark.e2e
def test_the_flow_run_is_named_after_the_job_and_carries_its_artifacts(faulty_run):
    """The flow run is renamed `job.name` once its config is checked (it was created with a generated name); its
    artifacts: progress at 100% after the last step, the summary, and no MLflow link (a SQLite store has no
    page to link to)."""
    from prefect.client.orchestration import get_client

    state, run_dir = faulty_run
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name == "faulty"
    artifacts = {a.key: a for a in flow_run_artifacts(flow_run_id)}
    assert set(artifacts) == {"faulty-progress", "faulty-summary"}  # no faulty-mlflow
    progress, summary = artifacts["faulty-progress"], artifacts["faulty-summary"]
    assert progress.type == "progress" and progress.data == 100.0
    assert progress.description == "faulty: step 3 of 3"
    assert summary.type == "markdown"
    last = read_metrics(run_dir)[-1]
    for row in ("| steps | 3 of 3 |", f"| final reward (rollout/reward_mean) | {last['rollout/reward_mean']:.4f} (step 3)",
                "| held-out accuracy (val/accuracy) |", f"`{run_dir.resolve()}`",
                f"`{run_dir.resolve() / 'checkpoints'}", f"| MLflow run | `{state.result()['mlflow_run_id']}` in "):
        assert row in summary.data, (row, summary.data)


@pytest.mark.e2e
def test_the_mlflow_link_has_no_credentials_and_the_progress_follows_the_steps():
    """The link artifact on an MLflow server (the URL is not fetched by Prefect: a made-up server does), and the
    progress artifact updated in place."""
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.artifacts import RunArtifacts
    from infra.tracking.items import server_run_url

    @flow
    def linked() -> str:
        artifacts = RunArtifacts("Link test_1", 4)
        artifacts.start(server_run_url("http://user:secret@127.0.0.1:5999/mlflow/", "7", "abc123"), "abc123", 1)
        artifacts.step(2)
        assert not artifacts.off
        return str(flow_run.id)

    found = {a.key: a for a in flow_run_artifacts(linked())}
    assert set(found) == {"link-test-1-mlflow", "link-test-1-progress"}
    link, progress = found["link-test-1-mlflow"], found["link-test-1-progress"]
    assert link.data == "[MLflow run abc123](http://127.0.0.1:5999/mlflow/#/experiments/7/runs/abc123)"
    assert progress.data == 50.0 and progress.description == "Link test_1: step 2 of 4"


@pytest.mark.e2e
def test_injected_failures_are_retried_and_no_step_is_lost(faulty_run):
    state, run_dir = faulty_run
    runs = task_runs(state.state_details.flow_run_id)
    retried = {phase(r.name) for r in runs if r.run_count > 1}
    assert retried == {"rollout", "reward"}
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == [1, 2, 3]


@pytest.mark.e2e
def test_metrics_have_every_key_family(faulty_run):
    _, run_dir = faulty_run
    records = read_metrics(run_dir)
    step1 = records[0]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/reward_mean",
                "rollout/reward_std", "rollout/response_len_mean", "rollout/truncation_rate",
                "rollout/zero_adv_group_frac", "rollout/logp_abs_diff", "perf/rollout_s", "perf/train_s",
                "perf/step_s", "perf/tokens_per_s"):
        assert key in step1, key
    assert "val/accuracy" in records[1] and "val/accuracy" in records[2]
    assert "val/accuracy" not in step1
    # the engine samples with the weights the trainer differentiates: log-probs agree
    assert step1["rollout/logp_abs_diff"] < 1e-4
    assert len(step1["data/prompt_rows"]) == 4


@pytest.mark.e2e
def test_rollout_and_train_stats_agree(faulty_run):
    """Cross-checks by formula: 16 completions give rewards in sixteenths; a step whose groups all have
    equal rewards has zero advantages (docs/objectives.md), hence a legacy-PG loss of exactly 0."""
    _, run_dir = faulty_run
    for r in read_metrics(run_dir):
        assert (r["rollout/reward_mean"] * 16) == pytest.approx(round(r["rollout/reward_mean"] * 16))
        assert r["rollout/zero_adv_group_frac"] * 4 == pytest.approx(round(r["rollout/zero_adv_group_frac"] * 4))
        if r["rollout/zero_adv_group_frac"] == 1.0:
            assert r["train/advantage_mean"] == 0.0 and r["train/advantage_std"] == 0.0
            assert r["train/loss"] == 0.0 and r["train/pg_loss"] == 0.0
        else:
            assert r["train/advantage_std"] > 0.0


@pytest.mark.e2e
def test_rollout_cache_is_pruned_with_each_checkpoint(faulty_run):
    """Each step's rollout is kept in the run directory until a checkpoint makes it unnecessary (one file per step
    used to stay forever: 402 files after 400 steps); the final checkpoint (step 3) leaves none."""
    _, run_dir = faulty_run
    assert (run_dir / "cache").is_dir() and list((run_dir / "cache").iterdir()) == []


def test_prune_rollout_cache_keeps_later_steps_and_other_files(tmp_path):
    from tasks.rollout import prune_rollout_cache

    names = [f"rollout-{step:08d}-{'a' * 32}.safetensors" for step in range(1, 6)]
    for name in [*names, f"rollout-{'b' * 32}.safetensors", "notes.txt"]:
        (tmp_path / name).write_text("x")
    assert prune_rollout_cache(tmp_path, 3) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", *names[3:]]


def test_a_cached_rollout_sampled_across_policy_versions_is_regenerated(tmp_path):
    """rollout.in_flight_updates: a cached rollout whose tokens came from several versions is not read back (a
    resumed run never made its later versions); the same rows from one version are."""
    from rl_core.rollout import build_completions
    from tasks.rollout import _read_cached

    one = build_completions([[1, 2], [3]], [[4, 5], [6, 0]], [[-0.1, -0.2], [-0.3, -0.4]], n=1, eos_token_id=0,
                            pad_token_id=0, max_tokens=4, policy_version=2)
    one.save(tmp_path / "one.safetensors")
    assert _read_cached(tmp_path / "one.safetensors", 2) is not None
    one.token_version = (one.response_mask > 0).long() * 2
    one.token_version[0, -1] = 3
    one.save(tmp_path / "mixed.safetensors")
    assert _read_cached(tmp_path / "mixed.safetensors", 2) is None


@pytest.mark.e2e
def test_a_second_identical_rollout_hits_the_cache_and_a_planted_file_is_never_executed(in_workdir, tmp_path):
    import pickle

    from prefect import flow

    from infra.cluster.roles import RolloutRole
    from rl_core.config import load_config
    from rl_core.model.loading import load_policy
    from rl_core.rollout import HFEngine
    from tasks.rollout import rollout_cache_file, rollout_task

    cfg = load_config(recipe("arithmetic"), FAST)
    role = RolloutRole.build(cfg)
    engine = HFEngine(*load_policy(cfg.model), seed=0)
    calls = []
    real = engine.generate

    def counting_generate(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    engine.generate = counting_generate
    cache = tmp_path / "cache"
    prompts = role.prompts([1, 2])
    planted_ident = {"config": "x", "step": 3, "version": 0}
    sampling3 = role.sampling(3)

    class Exploit:  # what a pickle-based cache would run on load
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    cache.mkdir()
    planted = cache / rollout_cache_file(prompts, 2, sampling3, planted_ident)
    planted.write_bytes(pickle.dumps(Exploit()))

    @flow
    def rollouts():
        args = (engine, prompts, 2, role.sampling(1), {"config": "x", "step": 1, "version": 0})
        first = rollout_task(*args, cache_dir=str(cache), step=1)
        second = rollout_task(*args, cache_dir=str(cache), step=1)
        other = rollout_task(engine, prompts, 2, role.sampling(2), {"config": "x", "step": 2, "version": 0},
                             cache_dir=str(cache), step=2)
        third = rollout_task(engine, prompts, 2, sampling3, planted_ident, cache_dir=str(cache), step=3)
        return first, second, other, third

    (first, first_s), (second, second_s), (other, _), (third, _) = rollouts()
    assert first_s > 0 and second_s == 0.0  # seconds inside generate; none for the one read back
    assert len(calls) == 3, "the identical call is read back; the planted file is regenerated over"
    for field in ("input_ids", "attention_mask", "response_mask", "sampling_logp", "prompt_index"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert first.finish_reason == second.finish_reason and first.n == second.n == 2
    assert not torch.equal(first.sampling_logp, other.sampling_logp)  # another step's seed: its own rollout
    assert not (tmp_path / "pwned").exists()  # nothing in the planted file ran
    assert planted.read_bytes()[:8] != pickle.dumps(Exploit())[:8]  # replaced by a real rollout
    assert len(third) == 4 and sorted(p.suffix for p in cache.iterdir()) == [".safetensors"] * 3


@pytest.mark.e2e
def test_gate_refuses_a_nan_reward_before_any_worker_trains(in_workdir, monkeypatch):
    import flows.on_policy
    from flows.grpo import grpo

    monkeypatch.setattr(flows.on_policy, "reward_task", faulty_reward_task(nan=1))
    state = grpo(recipe("arithmetic"), [*FAST, "job.name=gate", "rl.max_steps=2", "job.task_retries=0"],
                 return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception) as info:
        state.result()
    message = str(info.value)
    assert "batch refused before dispatch" in message
    assert "NaN" in message and "reward" in message and "rows [0" in message
    steps = [r["step"] for r in read_metrics(in_workdir / "runs" / "gate")]
    assert steps == [0], "no step may be trained from a refused batch"
    assert not (in_workdir / "runs" / "gate" / "checkpoints").exists() or not any(
        (in_workdir / "runs" / "gate" / "checkpoints").glob("step_*"))


@pytest.mark.e2e
def test_one_and_two_workers_agree(in_workdir, tmp_path):
    from flows.grpo import grpo
    from rl_core.model.loading import build_tiny_model

    # The random-init policy earns no reward (zero advantages), so a KL anchor to another random
    # model gives the step a non-zero gradient to compare.
    reference = build_tiny_model(tmp_path / "reference", seed=1)
    common = [*FAST, "rl.max_steps=1", "rl.validation.before_training=false", "rollout.prompts_per_step=4",
              "rl.objective.kl_beta=0.1", f"rl.reference={reference}", "rl.optimizer.lr=1e-3"]
    grpo(recipe("arithmetic"), [*common, "job.name=w1", "cluster.num_workers=1"])
    grpo(recipe("arithmetic"), [*common, "job.name=w2", "cluster.num_workers=2"])
    one, two = read_metrics(in_workdir / "runs" / "w1")[0], read_metrics(in_workdir / "runs" / "w2")[0]
    assert one["data/prompt_rows"] == two["data/prompt_rows"]
    assert one["rollout/reward_mean"] == two["rollout/reward_mean"]
    assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-6)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    w1 = load_file(next((in_workdir / "runs" / "w1" / "final_model").glob("*.safetensors")))
    w2 = load_file(next((in_workdir / "runs" / "w2" / "final_model").glob("*.safetensors")))
    moved = 0.0
    init = load_file(next((in_workdir / "artifacts" / "tiny-model" / "init").glob("*.safetensors")))
    for name in w1:
        # Adam's first step moves each weight by ~lr * g / (|g| + eps): elements whose gradient is
        # near eps are sensitive to the ranks' float summation order, hence 1% of lr (1e-3).
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-5)
        moved = max(moved, float((w1[name] - init[name]).abs().max()))
    assert moved > 0, "the step changed no weight"
