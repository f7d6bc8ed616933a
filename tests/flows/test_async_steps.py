"""`rl.async_steps`: the rollouts of the next steps overlapped with a step's training, end to end (real Prefect, real
local Ray, a separate HF engine), and the option off: the flow's trajectory equals, bit for bit, the plain
on-policy loop written out here with rl_core alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import recipe

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIPPED = ["rl.objective.type=grpo", "rollout.prompts_per_step=8", "rollout.n=4",
           "rl.validation.before_training=false", "rl.validation.every_steps=0", "rl.validation.max_prompts=8",
           "rl.resume=auto"]
ASYNC = [*CLIPPED, "cluster.placement=separate", "rollout.num_engines=1", "rl.async_steps=2"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_steps_keeps_k_rollouts_in_flight_within_the_bound_and_resumes_them_from_a_checkpoint(in_workdir,
                                                                                                     warm_model):
    """rl.async_steps=2: step 1 samples with version 0 and trains it on-policy (ρ = 1 exactly); steps 2 and 3
    were drawn with it too (staleness 1, 2), and from then on step s+2's rollout is drawn as step s begins, with
    version s-1 (staleness up to 2, ρ ≠ 1: π_old is the behaviour policy). Every step's prompts are the sampler's
    stream in order. The checkpoint of step 2 was written with steps 3 and 4 in flight: it keeps their rows and the
    sampler after drawing them, and a run resumed from it (the later checkpoints gone, as after a crash) draws steps
    3, 4, 5 again, the same prompts, neither skipped nor trained twice, and samples them with the restored weights
    (staleness 0, 1, 2)."""
    import shutil

    from flows.grpo import grpo
    from infra.checkpoints.store import CheckpointStore
    from rl_core.data import PromptSampler

    overrides = [*ASYNC, f"model.name_or_path={warm_model[0]}", "rl.max_steps=5", "rl.save_every=2",
                 "job.name=overlap"]
    grpo(recipe("arithmetic"), overrides)
    run_dir = in_workdir / "runs" / "overlap"
    whole = read_metrics(run_dir)
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5]
    stale = [r["rollout/policy_staleness"] for r in whole]
    # rollouts 1-3 are drawn at the start, with version 0; a later one is drawn with the version before its step's
    # trainer (2 behind), or, when its task thread reaches the engine only after the next sync, a newer one (truthfully
    # recorded, and still within the bound)
    assert stale[:3] == [0.0, 1.0, 2.0] and all(1.0 <= x <= 2.0 for x in stale[3:]), stale
    assert [r["perf/policy_version"] for r in whole] == [1, 2, 3, 4, 5]
    assert whole[0]["train/ratio_min"] == whole[0]["train/ratio_max"] == 1.0
    assert all(r["train/ratio_min"] < 1.0 < r["train/ratio_max"] for r in whole[1:])
    assert all(r["rollout/logp_abs_diff"] > 1e-4 for r in whole[1:])  # the engine sampled older weights

    store = CheckpointStore(run_dir / "checkpoints")
    parts, _ = store.load(2)
    saved = parts["driver"]["sampler"]
    stream = PromptSampler(**{k: saved[k] for k in ("num_examples", "batch_size", "seed")})
    expected = [stream.next_batch() for _ in range(5)]  # the prompt stream from the start, one batch per step
    assert [r["data/prompt_rows"] for r in whole] == expected
    # step 2's checkpoint: the rows of steps 3 and 4 (in flight), and the sampler after drawing them
    assert parts["driver"]["in_flight_rows"] == expected[2:4]
    resumed_sampler = PromptSampler(**{k: saved[k] for k in ("num_examples", "batch_size", "seed")})
    resumed_sampler.load_state_dict(saved)
    assert resumed_sampler.next_batch() == expected[4]

    for later in (3, 4, 5):  # a crash after step 2's checkpoint: only it is left
        shutil.rmtree(store.path_for(later), ignore_errors=True)
    grpo(recipe("arithmetic"), overrides)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:2] == whole[:2]  # restored from the checkpoint
    assert [r["data/prompt_rows"] for r in resumed] == expected
    assert [r["rollout/policy_staleness"] for r in resumed[2:]] == [0.0, 1.0, 2.0]
    assert resumed[2]["train/ratio_min"] == resumed[2]["train/ratio_max"] == 1.0  # step 3 is on-policy now


def test_dynamic_sampling_runs_asynchronously_its_rounds_in_stream_order_and_resumes_the_steps_in_flight(
        in_workdir, warm_model):
    """rl.async_steps=1 with rollout.filter_groups, from the warm start (groups that all pass, and some that split):
    step s+1's rows are drawn as step s begins, and step s's extra rounds draw after them, so the sampler's stream
    is D1 D2 E1 D3 E2 D4 E3 E4 (D: a step's first round, E: its extra rounds). The checkpoint of step 2 keeps step
    3's rows (in flight) and the sampler after E2; a run resumed from it trains step 3 on those rows again, sampled
    with the restored weights."""
    import shutil

    from flows.grpo import grpo
    from infra.checkpoints.store import CheckpointStore
    from rl_core.data import PromptSampler

    per_step = 8
    overrides = [*ASYNC, "rl.async_steps=1", f"model.name_or_path={warm_model[0]}", "rollout.filter_groups=true",
                 "rollout.filter_max_rounds=2", "rl.max_steps=4", "rl.save_every=2", "job.name=async-filter"]
    grpo(recipe("arithmetic"), overrides)
    run_dir = in_workdir / "runs" / "async-filter"
    whole = read_metrics(run_dir)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert sum(r["rollout/filter/rounds"] for r in whole) >= 1, whole  # the filter had work to do
    assert all(len(r["data/prompt_rows"]) == per_step for r in whole)
    first = [r["data/generated_rows"][:per_step] for r in whole]
    extra = [r["data/generated_rows"][per_step:] for r in whole]
    order = [first[0], first[1], extra[0], first[2], extra[1], first[3], extra[2], extra[3]]

    parts, _ = CheckpointStore(run_dir / "checkpoints").load(2)
    saved = parts["driver"]["sampler"]
    stream = PromptSampler(**{k: saved[k] for k in ("num_examples", "batch_size", "seed")})
    assert [stream.next_batch(len(rows)) if rows else [] for rows in order] == order
    assert parts["driver"]["in_flight_rows"] == [first[2]]
    after = PromptSampler(**{k: saved[k] for k in ("num_examples", "batch_size", "seed")})
    after.load_state_dict(saved)  # after D3 and E2: step 4's draw comes next
    assert after.next_batch() == first[3]

    for later in (3, 4):  # a crash after step 2's checkpoint: only it is left
        shutil.rmtree(CheckpointStore(run_dir / "checkpoints").path_for(later), ignore_errors=True)
    grpo(recipe("arithmetic"), overrides)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[:2] == whole[:2]
    assert resumed[2]["data/generated_rows"][:per_step] == first[2]  # step 3's rows again
    assert resumed[2]["rollout/policy_staleness"] == 0.0  # sampled with the restored weights


def test_in_flight_updates_land_inside_the_rollouts_and_every_token_keeps_its_version(in_workdir):
    """rollout.in_flight_updates with rl.async_steps=2: a sync does not wait for the rollouts in flight; the engine
    takes the new weights between two decoding steps (its weight-sync thread beside the generate). The random-init
    model samples to rollout.max_tokens: a batch of 8 rows of 320 tokens is 320 decoding steps, against one forward
    and backward to train it, so generating it takes several times as long as training it (5-9x here, idle or with
    three busy processes beside the run's two cores). The first sync then comes while the engine still works through
    the rollouts queued at the start, and lands inside one of them (its mean lag below its oldest token's); every
    batch stays within the bound."""
    from flows.grpo import grpo

    init = in_workdir / "artifacts" / "tiny-model" / "init"
    grpo(recipe("arithmetic"), [*ASYNC, f"model.name_or_path={init}", "rollout.max_tokens=320", "rollout.prompts_per_step=4",
                                "rollout.n=2", "rl.max_steps=4", "rl.save_every=0", "rollout.in_flight_updates=true",
                                "job.name=in-flight"])
    records = read_metrics(in_workdir / "runs" / "in-flight")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    mean = [r["rollout/policy_staleness"] for r in records]
    most = [r["rollout/policy_staleness_max"] for r in records]
    # step s trains version s-1 on tokens no older than version max(0, s-3); a rollout whose task thread reaches the
    # engine after a sync samples the newer weights, so a later batch may lag less than its draw did
    assert mean[0] == most[0] == 0.0 and all(x <= min(s - 1, 2) for s, x in enumerate(most, 1)), (mean, most)
    # rollouts 1-3 are queued at the start, so the engine is still generating when version 1 arrives (after step
    # 1's rollout, reward and training): that sync lands inside a batch, whose tokens then lag by two amounts
    assert any(m < x for m, x in zip(mean[1:], most[1:])), (mean, most, [r["perf/generate_s"] for r in records],
                                                           [r["perf/train_compute_s"] for r in records])
    for r in records:  # the shares of tokens per lag: all of them, and their mean is the mean lag
        shares = [r[f"rollout/tokens_lag_{k}"] for k in range(3)]
        assert sum(shares) == pytest.approx(1.0) and sum(k * x for k, x in enumerate(shares)) == pytest.approx(
            r["rollout/policy_staleness"]), r


def test_with_the_option_off_the_trajectory_is_the_plain_on_policy_loop_bit_for_bit(in_workdir, warm_model):
    """rl.async_steps=0 (the default): every step samples with the weights the step before produced. The flow's
    losses and final weights equal those of that loop, written out here in-process with rl_core (one thread, as
    the trainer actor), bit for bit."""
    from flows.grpo import grpo
    from infra.cluster.roles import RolloutRole
    from infra.workers.engines import build_engine
    from infra.workers.policy import build_trainer
    from rl_core.annotate import annotate
    from rl_core.config import load_config
    from rl_core.rewards import reward_inputs, score
    from rl_core.rewards.configured import reward_functions

    overrides = [*CLIPPED, f"model.name_or_path={warm_model[0]}", "rl.max_steps=3", "rl.save_every=0",
                 "rl.async_steps=0", "job.name=sync"]
    grpo(recipe("arithmetic"), overrides)
    flow = read_metrics(in_workdir / "runs" / "sync")

    cfg = load_config(recipe("arithmetic"), overrides)
    role = RolloutRole.build(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer, tokenizer = build_trainer(cfg, None, torch.device("cpu"))
        engine = build_engine(cfg, torch.device("cpu"), model=trainer.model, tokenizer=tokenizer,
                              max_model_len=role.max_model_len, sleep_mode=True)
        engine.set_policy_version(0)
        losses = []
        for step in range(1, 4):
            rows = role.sampler.next_batch()
            completions = engine.generate(role.prompts(rows), cfg.rollout.n, role.sampling(step), prompt_offset=0)
            examples = [role.train[rows[i]] for i in completions.prompt_index.tolist()]
            rewards, _ = score(reward_functions(cfg.data), reward_inputs(examples, completions.decode_responses(tokenizer)))
            batch = annotate(completions, rewards, rows, rl=cfg.rl, first_sample_id=(step - 1) * len(rewards)).batch
            losses.append(trainer.train_step(batch, cfg.rl.micro_batch_per_replica,
                                             cfg.rl.mini_batch_per_replica)["train/loss"])
            trainer.release_gradients()
            engine.set_policy_version(step)
    finally:
        torch.set_num_threads(threads)
    assert [r["rollout/policy_staleness"] for r in flow] == [0.0, 0.0, 0.0]
    assert [r["train/loss"] for r in flow] == [float(x) for x in losses]
    assert any(r["rollout/reward_mean"] not in (0.0, 1.0) for r in flow), "no step had a learning signal"
    saved = load_file(next((in_workdir / "runs" / "sync" / "final_model").glob("*.safetensors")))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_an_agent_task_trains_asynchronously_and_resumes_with_its_episodes_in_flight(in_workdir, tmp_path):
    """Multi-turn games (recipes/guess_number.py) with rl.async_steps=1 on a separate HF engine, scheduled per episode:
    step s+1's episodes are played while step s trains (a sync that lands between two turns of an episode is
    tests/rl_core/test_async_episodes.py's, where it is placed exactly); every batch is within the bound and the
    shares of its tokens per lag cover them all, their mean the mean lag. The checkpoint of step 2 was written with
    step 3's episodes in flight: a run resumed from it plays step 3's games again (the same rows, sampled by the
    restored weights) and trains no step twice."""
    import shutil

    from examples.guess_number import main as build_data
    from flows.grpo import grpo
    from infra.checkpoints.store import CheckpointStore
    from tests.flows.test_agents_flow import talkative_model

    build_data(["--out", "data/guess-number", "--seed", "0"])
    model = talkative_model(in_workdir, tmp_path / "talkative")
    overrides = [*ASYNC, "rl.async_steps=1", f"model.name_or_path={model}", "rollout.max_tokens=4", "rl.max_steps=3",
                 "rl.save_every=2", "job.name=async-games", "tracking.system_metrics=false"]
    grpo(recipe("guess_number"), overrides)
    run_dir = in_workdir / "runs" / "async-games"
    whole = read_metrics(run_dir)
    assert [r["step"] for r in whole] == [1, 2, 3]
    assert whole[0]["rollout/turns_max"] >= 2  # games of several turns
    for r in whole:
        shares = [r["rollout/tokens_lag_0"], r["rollout/tokens_lag_1"]]
        assert sum(shares) == pytest.approx(1.0) and shares[1] == pytest.approx(r["rollout/policy_staleness"]), r
        assert r["rollout/policy_staleness_max"] <= 1
    assert whole[0]["rollout/policy_staleness"] == 0.0 and whole[1]["rollout/policy_staleness_max"] == 1

    store = CheckpointStore(run_dir / "checkpoints")
    shutil.rmtree(store.path_for(3), ignore_errors=True)  # a crash after step 2's checkpoint
    grpo(recipe("guess_number"), overrides)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == whole[:2]
    assert resumed[2]["data/prompt_rows"] == whole[2]["data/prompt_rows"]
    assert resumed[2]["rollout/policy_staleness"] == 0.0  # drawn again, with the restored weights
