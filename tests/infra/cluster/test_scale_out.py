"""Scale-out on Ray: rollout engines as actors, weight sync that bypasses the driver, placement rules.

In-process tests use the session's local Ray (conftest). The multi-node and external-cluster
tests are in `test_ray_cluster.py`.
"""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, recipe


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(next((run_dir / "final_model").glob("*.safetensors")))


# ------------------------------------------------------------------------------------ engines


@pytest.mark.e2e
def test_each_thread_reads_the_generate_time_of_its_own_call():
    """rl.async_steps: the in-flight rollout (a task thread) and an evaluation (the flow's thread) call the same
    EnginePool at once; each must read back the seconds of its own call, not the other's."""
    import threading

    from infra.workers.engines import EnginePool
    from rl_core.rollout.base import build_completions

    completions = build_completions([[1, 5]], [[9, 2]], [[-0.5, -0.5]], n=1, eos_token_id=2, pad_token_id=0,
                                    max_tokens=4, policy_version=0)

    class Actor:  # answers generate(prompts, n, sampling, offset) with (completions, seconds = n)
        class generate:  # Ray's actor.method.remote(...) shape
            @staticmethod
            def remote(prompts, n, sampling, offset):
                return ray.put((completions, float(n)))

    pool = EnginePool([Actor()])
    called, other_done, seen = threading.Event(), threading.Event(), []

    def rollout():
        pool.generate([[1, 5]], 2, None)
        called.set()
        other_done.wait(10)
        seen.append(pool.last_generate_s)

    thread = threading.Thread(target=rollout)
    thread.start()
    assert called.wait(10)
    pool.generate([[1, 5]], 3, None)  # the evaluation's call, between the rollout's call and its read
    other_done.set()
    thread.join(10)
    assert seen == [2.0] and pool.last_generate_s == 3.0


@pytest.mark.e2e
def test_engines_and_placements_train_to_identical_weights_with_no_model_in_the_driver(in_workdir, warm_model,
                                                                                       monkeypatch):
    """1 vs 2 separate engines and colocated: the same rollouts (prompt rows, rewards, lengths), losses equal to the
    last bit and bitwise-equal step-3 weights, which different completions would not give. At every step (after
    rollout, train, sync and checkpoint) the driver has no module with parameters and no tensor anywhere near
    the size of the policy: the weights live in the actors only."""
    from flows.grpo import grpo
    from flows.runner import TrainingRun
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy

    model, _ = load_policy(ModelConfig(name_or_path=str(warm_model[0])))
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    del model

    def live() -> list:
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects warns
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects() if isinstance(o, (torch.nn.Module, torch.Tensor))]

    gc.collect()
    before = {id(o) for o in live()}
    seen: list[tuple[int, int, int]] = []
    real_log = TrainingRun.log

    def checking_log(self, record, bar):
        gc.collect()
        new = [o for o in live() if id(o) not in before]
        modules = [o for o in new if isinstance(o, torch.nn.Module) and any(True for _ in o.parameters())]
        tensors = [o for o in new if isinstance(o, torch.Tensor)]
        seen.append((len(modules), sum(t.numel() for t in tensors), max((t.numel() for t in tensors), default=0)))
        return real_log(self, record, bar)

    monkeypatch.setattr(TrainingRun, "log", checking_log)
    common = [*FAST, f"model.name_or_path={warm_model[0]}", "rl.max_steps=3", "rl.validation.before_training=false",
              "rl.validation.every_steps=0", "rl.validation.max_prompts=8", "rl.save_every=1"]
    runs = {"e1": ["cluster.placement=separate", "rollout.num_engines=1"],
            "e2": ["cluster.placement=separate", "rollout.num_engines=2"],
            "colocated": ["cluster.placement=colocated"]}
    for name, extra in runs.items():
        grpo(recipe("arithmetic"), [*common, f"job.name={name}", *extra])
    metrics = {name: read_metrics(in_workdir / "runs" / name) for name in runs}
    one = metrics["e1"]
    assert [r["step"] for r in one] == [1, 2, 3]
    for name in ("e2", "colocated"):
        for a, b in zip(one, metrics[name]):
            assert a["data/prompt_rows"] == b["data/prompt_rows"]
            assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
            assert a["rollout/response_len_mean"] == b["rollout/response_len_mean"]
            assert a["train/loss"] == b["train/loss"]
            assert b["rollout/logp_abs_diff"] < 1e-5  # the engines sampled with the trainer's weights
    for a, b in zip(one, metrics["e2"]):  # rank 0 broadcast the whole policy each step
        assert a["perf/weight_sync_bytes"] == b["perf/weight_sync_bytes"] > 0
    assert all(r["perf/weight_sync_bytes"] == 0 for r in metrics["colocated"])  # in process: nothing moves
    assert any(r["rollout/reward_mean"] not in (0.0, 1.0) for r in one), "no step had a learning signal"
    w1 = final_weights(in_workdir / "runs" / "e1")
    for name in ("e2", "colocated"):
        other = final_weights(in_workdir / "runs" / name)
        for key in w1:
            assert torch.equal(w1[key], other[key]), (name, key)
    assert len(seen) == 9  # 3 steps, 3 runs
    for modules, total, biggest in seen:
        assert modules == 0
        assert total < params // 10, f"{total} tensor elements alive in the driver (the policy has {params})"
        assert biggest < largest


@pytest.fixture(scope="module")
def separate_cluster(workdir, warm_model):
    """Two separate HF engines; the last test using it corrupts one of them."""
    from infra.cluster.cluster import Cluster
    from rl_core.config import load_config

    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={warm_model[0]}", "cluster.placement=separate",
                                             "rollout.num_engines=2"])
    with Cluster(cfg, max_model_len=32) as cluster:
        yield cluster


@pytest.mark.e2e
def test_weight_sync_bytes_equal_the_policy_size(separate_cluster, warm_model):
    """What rank 0 broadcasts per sync is exactly the policy's parameters in the wire dtype (float32: 4 bytes)."""
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy

    model, _ = load_policy(ModelConfig(name_or_path=str(warm_model[0])))
    expected = sum(t.numel() * 4 for t in model.state_dict().values())
    del model
    stats = separate_cluster.sync_weights(7)
    assert stats["perf/weight_sync_bytes"] == expected
    where = separate_cluster.node_map()
    assert len(where["engines"]) == 2
    assert {e["pid"] for e in where["engines"]}.isdisjoint({t["pid"] for t in where["trainers"]})


@pytest.mark.e2e
def test_multi_turn_episodes_advance_over_two_separate_engines_token_exactly(separate_cluster, warm_model):
    """Agent episodes (examples/guess_number.py) on two separate HF engines: each turn's live episodes are one batched
    call split over the engines, the replies are appended as template deltas, and the trainer's float32 log-probs of
    exactly the episodes' ids equal the engines' on every sampled token."""
    from examples.guess_number import GuessNumber, prompt
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_tokenizer
    from rl_core.rollout import SamplingParams
    from rl_core.tasks import Example
    from rl_core.tasks.environment import EnvironmentTask
    from tests.run_helpers import trainer_logprobs

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(warm_model[0])))
    task = EnvironmentTask(GuessNumber, "examples.guess_number:GuessNumber")
    rows = [Example(prompt(6), str(secret), columns={"high": 6}) for secret in (2, 5, 6, 4)]
    completions, _ = rollout_episodes(separate_cluster.engines, task, rows, tokenizer, 2,
                                      SamplingParams(temperature=1.0, max_tokens=4, seed=3), max_turns=3,
                                      max_episode_tokens=160)
    assert max(e["stats"]["turns"] for e in completions.episodes) >= 2  # the sums' two-digit answers get replies
    replies = (completions.attention_mask > 0) & (completions.response_mask == 0)
    assert replies[:, completions.prompt_length:].any()  # real tokens after the prompt that nobody sampled
    expected = trainer_logprobs(warm_model[0], completions, temperature=1.0)
    assert (completions.sampling_logp - expected).abs().max().item() <= 1e-5


@pytest.mark.e2e
def test_an_engine_that_loads_a_weight_wrong_fails_the_sync(separate_cluster):
    """Engine 1 receives the right bytes but loads one tensor wrong (tests/faults.py): its own report of
    what it holds differs from rank 0's, and the sync stops naming the engine and the tensor; the next sync is
    clean."""
    from infra.cluster.cluster import WeightSyncError
    from tests.faults import load_one_weight_wrong

    name = ray.get(separate_cluster.engine_actors[1].__ray_call__.remote(load_one_weight_wrong))  # its next load
    with pytest.raises(WeightSyncError, match=rf"engine 1 does not hold what trainer rank 0 sent: tensor {name}: sum "):
        separate_cluster.sync_weights(3)
    stats = separate_cluster.sync_weights(4)
    assert stats["rollout/sync_probe_logp_abs_diff"] < 1e-6  # both engines: their probe log-probs are the trainer's


@pytest.mark.e2e
def test_a_corrupted_sync_fails_the_step(separate_cluster):
    """An engine whose received bytes do not match rank 0's checksum stops the sync with WeightSyncError."""
    from infra.cluster.cluster import WeightSyncError

    separate_cluster.sync_weights(1)

    def corrupt(worker):  # runs inside engine 1: every bucket it receives now "hashes" differently
        import infra.workers.distributed as d

        d.checksum = lambda flat: 12345
        return True

    ray.get(separate_cluster.engine_actors[1].__ray_call__.remote(corrupt))
    with pytest.raises(WeightSyncError, match=r"engine 1 reports version 2 with checksum"):
        separate_cluster.sync_weights(2)


# ------------------------------------------------------------------------------------ placement


def _held_by_this_job() -> set[str]:
    """The placement groups not removed and the actors not dead of this process's Ray job: what a run left behind
    shows here (the pytest workers share one Ray, so its free CPUs also move with the other workers' flows). A
    placement group's id ends with its job's id."""
    job = ray.get_runtime_context().get_job_id()
    groups = {g["placement_group_id"] for g in ray.util.placement_group_table().values()
              if g["placement_group_id"].endswith(job) and g["state"] != "REMOVED"}
    actors = {a for a, info in ray._private.state.actors().items() if info["JobID"] == job and info["State"] != "DEAD"}
    return groups | actors


@pytest.mark.e2e
def test_placement_timeout_names_what_could_not_be_placed(in_workdir, warm_model):
    from infra.cluster.cluster import Cluster, PlacementError
    from rl_core.config import load_config

    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={warm_model[0]}", "cluster.cpus_per_worker=64",
                                             "cluster.placement_timeout_s=2"])
    held_before = _held_by_this_job()
    with pytest.raises(PlacementError) as info, Cluster(cfg, max_model_len=32):
        pass
    message = str(info.value)
    assert "1 trainer rank(s)" in message and "{'CPU': 64.0}" in message
    assert "cluster.placement_timeout_s=2" in message and "available now: CPU=" in message
    # nothing is left behind: the placement group was removed
    from infra.processes import wait_until

    assert wait_until(lambda: _held_by_this_job() == held_before, 10), _held_by_this_job() - held_before


@pytest.mark.e2e
def test_actors_started_early_are_taken_by_the_cluster_of_the_same_config_only(in_workdir, warm_model):
    """`posttrain run` starts the trainer ranks, the separate engines and the reward workers while Prefect's API
    starts (infra.cluster.placement.Placement.start_actors_early) and offers its placement: the flow's Cluster takes those very
    actors, already past their imports, and they train and sync, and its RewardPool takes the reward workers; a
    Cluster of another config kills them all and places its own; none is left behind."""
    from infra.cluster.cluster import Cluster
    from infra.cluster.placement import Placement
    from infra.processes import wait_until
    from infra.workers.rewards import RewardPool
    from rl_core.config import load_config
    from rl_core.rewards import reward_inputs
    from rl_core.tasks import Example

    base = [f"model.name_or_path={warm_model[0]}", "cluster.num_workers=2", "cluster.placement=separate",
            "rollout.num_engines=1"]
    cfg = load_config(recipe("arithmetic"), base)
    held_before = _held_by_this_job()
    early = Placement(cfg)
    assert cfg.data.reward_workers == 1  # the recipe's default
    assert early.start_actors_early() == 4  # 2 trainer ranks, 1 engine, 1 reward worker
    trainers, engines = early.groups["trainers"].actors, early.groups["engines"].actors
    scorers = early.helpers["rewards"][1].actors
    assert len(ray.get([a.preload.remote() for a in trainers + engines])) == 3  # alive, their imports done
    with early.offered(), Cluster(cfg, max_model_len=32) as cluster, RewardPool(cfg, cluster.placement) as rewards:
        assert cluster.placement is early
        assert [w._actor_id for w in cluster.workers] == [w._actor_id for w in trainers]
        assert [e._actor_id for e in cluster.engine_actors] == [e._actor_id for e in engines]
        assert [a._actor_id for a in rewards.actors] == [a._actor_id for a in scorers]
        assert early.helpers == {}  # handed over once: the pool owns them
        assert Placement.take_offered(cfg) is None  # handed over once
        synced = cluster.sync_weights(1)  # set up, and joined to rank 0's weight-sync group: the checksums agree
        assert synced["perf/weight_sync_bytes"] > 0
        # the arithmetic task's exact-answer reward, scored in the early actor: "3" right, "4" wrong
        inputs = reward_inputs([Example("1+2=", "3", None, {"answer": "3"}, "t:1")] * 2, ["3", "4"])
        assert rewards.scores(inputs).rewards == [1.0, 0.0]
    assert early.groups == {}
    assert wait_until(lambda: _held_by_this_job() == held_before, 10), _held_by_this_job() - held_before

    early = Placement(cfg)
    early.start_actors_early()
    started = [*early.groups["trainers"].actors, *early.groups["engines"].actors, *early.helpers["rewards"][1].actors]
    other = load_config(recipe("arithmetic"), [*base, "rl.optimizer.lr=3e-4"])
    with early.offered(), Cluster(other, max_model_len=32) as cluster, RewardPool(other, cluster.placement) as rewards:
        placed = cluster.workers + cluster.engine_actors + rewards.actors
        assert len(rewards.actors) == 1 and not {a._actor_id for a in placed} & {a._actor_id for a in started}
        for actor in started:  # killed: they hold the wrong config
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.info.remote(), timeout=30)
    assert wait_until(lambda: _held_by_this_job() == held_before, 10), _held_by_this_job() - held_before


def test_actors_get_the_config_as_data_with_absolute_model_paths(in_workdir, tmp_path):
    """Workers never see the recipe file nor the driver's cwd: their config is plain data with absolute paths."""
    from infra.workers.actor import worker_config
    from rl_core.config import config_from_dict, load_config

    cfg = load_config(recipe("arithmetic"), ["model.name_or_path=artifacts/tiny-model/init", "rl.reference=./ref",
                                             "model.teacher=Qwen/Qwen2.5-7B-Instruct"])
    data = worker_config(cfg)
    assert data["model"]["name_or_path"] == str((in_workdir / "artifacts/tiny-model/init").resolve())
    assert data["rl"]["reference"] == str((in_workdir / "ref").resolve())
    assert data["model"]["teacher"] == "Qwen/Qwen2.5-7B-Instruct"  # hub ids stay hub ids
    again = config_from_dict(json.loads(json.dumps(data)))
    assert again.rl == cfg.rl.model_copy(update={"reference": data["rl"]["reference"]})


@pytest.mark.parametrize("overrides, needle", [
    (["cluster.num_workers=2", "cluster.gpus_per_worker=0.5"], "NCCL needs one whole GPU per rank"),
    (["cluster.num_workers=2", "rollout.num_engines=3"], "colocated engines are one per trainer rank"),
    (["cluster.cpus_per_engine=2"], "read only by cluster.placement=separate"),
])
def test_preflight_refuses_placements_that_cannot_work(overrides, needle):
    from rl_core.config import load_config
    from rl_core.preflight.rules import preflight

    report = preflight(load_config(recipe("arithmetic"), overrides))
    assert any(needle in e for e in report.errors), report.errors


def test_preflight_warns_about_vllm_inside_a_cpu_trainer():
    from rl_core.config import load_config
    from rl_core.preflight.rules import preflight

    colocated = preflight(load_config(recipe("arithmetic"), ["rollout.backend=vllm"]))
    separate = preflight(load_config(recipe("arithmetic"), ["rollout.backend=vllm", "cluster.placement=separate"]))
    assert any("prefer cluster.placement=separate" in w for w in colocated.warnings)
    assert not any("prefer cluster.placement=separate" in w for w in separate.warnings)


def test_a_one_slash_local_model_directory_reaches_the_actors_absolute(tmp_path, monkeypatch):
    """`model.name_or_path=ckpt/warm` that exists here is a local directory: the actors get its absolute path,
    while a missing `org/name` stays a hub id."""
    from infra.workers.actor import worker_config
    from rl_core.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt" / "warm").mkdir(parents=True)
    cfg = load_config(recipe("arithmetic"), ["model.name_or_path=ckpt/warm", "model.teacher=org/teacher"])
    data = worker_config(cfg)
    assert data["model"]["name_or_path"] == str((tmp_path / "ckpt" / "warm").resolve())
    assert data["model"]["teacher"] == "org/teacher"
