"""The model capability protocol and routing replay (rl_core/model/, docs/moe.md).

The MoE here is the tiny Mixtral (`build_tiny_moe_model`: 4 layers, 4 experts, top-2). Its routers are made sharp and
two experts' router rows almost equal (`near_tie`), so that the float noise between the engine's KV-cached
decoding and the trainer's full forward sends some tokens to the other expert: the sampler/trainer gap that routing
replay closes.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.batch.trajectory import Trajectory, TrajectoryError
from rl_core.model import routing
from rl_core.model.protocol import ModelCapabilities, RoutingReplay, capabilities
from rl_core.primitives.logprobs import forward_layout, sequence_token_logprobs
from rl_core.rollout.base import Completions, SamplingParams, concat_completions
from rl_core.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rl_core.model.loading import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "init", seed=0)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from rl_core.model.loading import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("dense") / "init", seed=0)


def load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return model, tokenizer


def near_tie(model, delta: float = 1e-7):
    """Sharpen every router (x50) and make expert 1's router row expert 0's plus `delta` noise."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight.mul_(50)
            r.weight[1] = r.weight[0] + delta * torch.randn(r.weight.shape[1], generator=gen)
    return model


def sample(model, tokenizer, *, record=True, n=4, max_tokens=32):
    engine = HFEngine(model, tokenizer, record_routes=record)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in ((12, 34), (7, 5), (99, 1), (40, 40))]
    return engine.generate(prompts, n, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1))


def logprobs(model, c, routes=None, record=False):
    with torch.no_grad():
        if routes is not None:
            with routing.replaying(model, routes) as bind:
                return sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0,
                                               loss_mask=c.response_mask), bind
        if record:
            with routing.recording(model) as bind:
                return sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0,
                                               loss_mask=c.response_mask), bind
        return sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0,
                                       loss_mask=c.response_mask), None


def test_capabilities_read_the_routers_and_a_dense_model_has_none(moe_dir, dense_dir):
    moe, _ = load(moe_dir)
    dense, _ = load(dense_dir)
    assert capabilities(moe).experts.layers == 4 and capabilities(moe).experts.experts == 4
    assert capabilities(moe).experts.top_k == 2
    assert capabilities(dense) == ModelCapabilities()
    with pytest.raises(ValueError, match="model.routing_replay=rollout: .*no mixture-of-experts router"):
        RoutingReplay(dense, "rollout")
    with pytest.raises(ValueError, match="model.routing_replay='sometimes'"):
        RoutingReplay(moe, "sometimes")


def test_a_dense_model_is_unchanged_by_every_routing_context(dense_dir):
    """A Llama has no router: recording and replaying bindings leave its log-probs bit for bit, and it records no
    routes from the engine."""
    model, tokenizer = load(dense_dir)
    c = sample(model, tokenizer, record=False)
    plain, _ = logprobs(model, c)
    fake = torch.zeros((*c.input_ids.shape, 4, 2), dtype=torch.uint8)
    replayed, bind = logprobs(model, c, routes=fake)
    assert torch.equal(plain, replayed) and int(bind.pairs) == 0
    with pytest.raises(RuntimeError, match="no mixture-of-experts router"):  # nothing to record: said, not an empty tensor
        logprobs(model, c, record=True)
    assert sample(model, tokenizer, record=False).routes is None


def test_the_engine_records_routes_where_tokens_were_fed(moe_dir):
    model, tokenizer = load(moe_dir)
    c = sample(model, tokenizer)
    assert c.routes.dtype == torch.uint8 and tuple(c.routes.shape) == (*c.input_ids.shape, 4, 2)
    known = (c.routes != routing.NOT_ROUTED).all(-1).all(-1)
    real = c.attention_mask.bool()
    assert not bool((known & ~real).any()), "padding has a route"
    # every real token is fed to a forward but the last sampled one of a row (it ends the sequence)
    last = real.long().cumsum(-1) == real.sum(-1, keepdim=True)
    assert bool(known[real & ~last].all())
    # the routes are what the trainer's own forward chooses (float32, no near tie): recorded bit for bit
    _, bind = logprobs(model, c, record=True)
    assert torch.equal(bind.recorded[known], c.routes[known])


@pytest.mark.parametrize("layout", ["rows", "packed", "padded"])
def test_replaying_a_routers_own_routes_changes_nothing(moe_dir, layout):
    model, tokenizer = load(moe_dir)
    c = sample(near_tie(model), tokenizer)
    with forward_layout(layout):
        own, bind = logprobs(model, c, record=True)
        replayed, replay = logprobs(model, c, routes=bind.recorded)
    assert torch.equal(own, replayed) and int(replay.differ) == 0 and int(replay.pairs) == int(c.attention_mask.sum()) * 4


def test_replay_sends_tokens_to_the_recorded_experts_and_closes_the_sampler_gap(moe_dir):
    """Near a tie the trainer's forward routes some tokens elsewhere than the engine did, and their log-probs move
    by far more than float noise; replaying the engine's routes sends every token where the engine sent it (the
    routers' own outputs, seen by a hook behind replay's) and brings the gap under 1e-5."""
    model, tokenizer = load(moe_dir)
    c = sample(near_tie(model), tokenizer)
    on = c.response_mask > 0
    plain, _ = logprobs(model, c)
    seen = {}
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2].clone()))
             for i, r in enumerate(routing.routers(model))]
    try:
        replayed, bind = logprobs(model, c, routes=c.routes)
    finally:
        for h in hooks:
            h.remove()
    assert int(bind.differ) > 0, "no token was routed differently: the near tie did not bite"
    assert float((plain - c.sampling_logp)[on].abs().max()) > 1e-3
    assert float((replayed - c.sampling_logp)[on].abs().max()) <= 1e-5
    # rows layout: token (b, t) of the batch is flat index b * width + (its position among the row's real tokens)
    real = c.attention_mask.bool()
    width = int(real.sum(-1).max())
    rows, cols = real.nonzero(as_tuple=True)
    flat = rows * width + (real.long().cumsum(-1) - 1)[rows, cols]
    recorded = c.routes[rows, cols]
    fed = (recorded != routing.NOT_ROUTED).all(-1).all(-1)
    for layer, chosen in seen.items():
        assert torch.equal(chosen[flat][fed].to(torch.uint8), recorded[fed, layer]), layer


def test_the_router_keeps_its_gradient_under_replay(moe_dir):
    model, tokenizer = load(moe_dir)
    c = sample(model, tokenizer)
    model.train()
    with routing.replaying(model, c.routes):
        lp = sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0, loss_mask=c.response_mask)
    lp.sum().backward()
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in routing.routers(model))


def test_routes_travel_exactly_through_every_split_and_the_cache_file(moe_dir, tmp_path):
    from rl_core.annotate import annotate
    from rl_core.config import RLConfig

    model, tokenizer = load(moe_dir)
    c = sample(model, tokenizer, n=2, max_tokens=8)
    path = tmp_path / "rollout.safetensors"
    c.save(path)
    back = Completions.load(path)
    assert torch.equal(back.routes, c.routes)
    # two engine shards of different prompt and response widths join like their tokens, padded NOT_ROUTED
    short = sample(model, tokenizer, n=2, max_tokens=3)
    joined = concat_completions([c, short])
    P = joined.prompt_length
    for part, rows in ((c, slice(0, len(c))), (short, slice(len(c), None))):
        left = P - part.prompt_length
        width = part.input_ids.shape[1]
        assert torch.equal(joined.routes[rows, left:left + width], part.routes)
        assert bool((joined.routes[rows, :left] == routing.NOT_ROUTED).all())
        assert bool((joined.routes[rows, left + width:] == routing.NOT_ROUTED).all())
    with pytest.raises(ValueError, match="some recorded mixture-of-experts routes"):
        concat_completions([c, sample(model, tokenizer, record=False, n=2, max_tokens=3)])

    batch = annotate(joined, [float(i % 2) for i in range(len(joined))], list(range(joined.num_prompts)),
                     rl=RLConfig(), first_sample_id=100)
    assert torch.equal(batch.batch.routes, joined.routes)
    assert batch.stats["rollout/routes_mb"] == joined.routes.numel() / 2**20
    b = batch.batch
    by_id = {int(s): b.routes[i] for i, s in enumerate(b.sample_ids)}
    parts = [*b.split(3), *b.token_budget_split(40), b.select([5, 0, 2]), b.slice(1, 4), b.to("cpu")]
    for part in parts:
        for i, s in enumerate(part.sample_ids.tolist()):
            assert torch.equal(part.routes[i], by_id[s])
    assert torch.equal(Trajectory.concat(b.split(3)).routes, b.routes)
    with pytest.raises(TrajectoryError, match="routes must be a"):
        b.replace(routes=b.routes.long())
    with pytest.raises(TrajectoryError, match="routes must be a"):
        b.replace(routes=b.routes[:, :-1])


def _trainer(model, mode: str, mini_batch_rows=None):
    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.training.trainer import LLMTrainer

    objective = build_objective(RLConfig(), ObjectiveContext(max_response_length=32))
    seen = []
    fn = objective.fn

    def spy(m, chunk):  # what the objective is given
        seen.append(chunk.routes)
        return fn(m, chunk)

    objective.fn = spy
    return LLMTrainer(model, objective, OptimizerConfig(lr=1e-3, max_grad_norm=1e9), routing_replay=mode), seen


def _batch(c):
    from rl_core.annotate import annotate
    from rl_core.config import RLConfig

    rewards = [float(len(r) % 2) for r in c.response_token_ids()]
    return annotate(c, rewards, list(range(c.num_prompts)), rl=RLConfig(), first_sample_id=0).batch


def test_the_trainer_replays_the_rollouts_routes_and_the_objective_never_sees_them(moe_dir):
    """model.routing_replay=rollout on the near-tie batch: the first step's sampler/trainer gap (the objective's own
    rollout_logp_abs_diff) is float noise with replay and far above it without; the objective gets every chunk
    without its routes."""
    import copy

    model, tokenizer = load(moe_dir)
    c = sample(near_tie(model), tokenizer)
    batch = _batch(c)
    gaps, metrics = {}, {}
    for mode in ("off", "rollout"):
        trainer, seen = _trainer(copy.deepcopy(model), mode)
        metrics[mode] = trainer.train_step(batch)
        gaps[mode] = metrics[mode]["train/rollout_logp_abs_diff"]
        assert seen and all(s is None for s in seen)
    assert gaps["rollout"] <= 1e-6 and gaps["off"] > 1e-5, gaps
    # the share of replayed (token, layer) pairs the routers would have sent elsewhere, counted here by hand
    _, bind = logprobs(model, c, routes=c.routes)
    assert metrics["rollout"]["train/routing_replay_differ_frac"] == int(bind.differ) / int(bind.pairs) > 0
    assert "train/routing_replay_differ_frac" not in metrics["off"]
    with pytest.raises(ValueError, match="the batch carries no routes"):
        _trainer(copy.deepcopy(model), "rollout")[0].train_step(batch.replace(routes=None))


def test_old_mode_records_the_pi_old_pass_and_replays_it_in_every_mini_batch(moe_dir, monkeypatch):
    """model.routing_replay=old with two mini-batches: the π_old pass records each row's routes, and both
    mini-batches' training forwards replay exactly those rows' routes (after the first update, too)."""
    model, tokenizer = load(moe_dir)
    batch = _batch(sample(near_tie(model), tokenizer))
    trainer, _ = _trainer(model, "old")
    replayed, recorded = [], []
    real_replaying, real_recording = routing.replaying, routing.recording

    def replaying(m, routes):
        replayed.append(routes.clone())
        return real_replaying(m, routes)

    def recording(m):
        cm = real_recording(m)
        bind = cm.__enter__()
        recorded.append(bind)

        class _Ctx:
            def __enter__(self):
                return bind

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return _Ctx()

    monkeypatch.setattr(routing, "replaying", replaying)
    monkeypatch.setattr(routing, "recording", recording)
    trainer.train_step(batch, mini_batch_size=len(batch) // 2)
    assert len(recorded) == 2 and len(replayed) == 2  # one π_old chunk and one training chunk per mini-batch
    assert torch.equal(torch.cat(replayed), torch.cat([b.recorded for b in recorded]))
    real = batch.attention_mask.bool()
    assert bool((torch.cat(replayed)[real] != routing.NOT_ROUTED).all())
    assert trainer.routing._old == {}  # cleared with the batch



def test_preflight_refuses_routing_replay_where_there_are_no_routes(moe_dir, dense_dir):
    from pathlib import Path

    from rl_core.config import load_config
    from rl_core.preflight.machine import routing_problem, vllm_build
    from rl_core.preflight.rules import preflight

    recipes = Path(__file__).resolve().parents[2] / "recipes"

    def errors(recipe, *overrides):
        return preflight(load_config(str(recipes / f"{recipe}.py"), list(overrides))).errors

    assert any(e.startswith("model.routing_replay=rollout with rl.objective.type=dpo")
               for e in errors("dpo_arithmetic", "model.routing_replay=rollout"))
    assert any(e.startswith("model.routing_replay=old with rl.async_steps=1")
               for e in errors("arithmetic", "rl.objective.type=grpo", "model.routing_replay=old", "rl.async_steps=1",
                               "cluster.placement=separate"))
    assert any(e.startswith("model.routing_replay=rollout with data.task=") and "max_turns=4" in e
               for e in errors("guess_number", "model.routing_replay=rollout"))
    report = preflight(load_config(str(recipes / "arithmetic.py"), ["rl.objective.type=grpo",
                                                                    "model.routing_replay=old"]))
    assert any("nothing to replay" in w for w in report.warnings) and not report.errors
    # the model itself: read from its config.json, no weights loaded
    cfg = load_config(str(recipes / "arithmetic.py"), [f"model.name_or_path={dense_dir}", "model.routing_replay=rollout"])
    problem = routing_problem(cfg)
    assert problem.startswith("model.routing_replay=rollout: model.name_or_path=") and "LlamaForCausalLM" in problem
    assert "set model.routing_replay=off" in problem
    moe = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(moe_dir)})})
    assert routing_problem(moe) is None
    on_vllm = moe.model_copy(update={"rollout": moe.rollout.model_copy(update={"backend": "vllm"})})
    if vllm_build() == "cpu":  # what `make test` installs here; a GPU build returns routes
        assert routing_problem(on_vllm).startswith("model.routing_replay=rollout with vLLM's CPU build")
    else:
        assert routing_problem(on_vllm) is None


def test_a_run_of_the_moe_recipe_builds_its_missing_model_and_warm_start(tmp_path, monkeypatch):
    """`posttrain run recipes/moe_arithmetic.py` on a fresh clone: the quickstart build makes the arithmetic data,
    the tiny Mixtral and its warm start with params.yaml's values (here a 2-step warm start), as the DVC stages do."""
    import json
    from pathlib import Path

    import yaml

    from infra.artifacts import TINY_MOE_INIT, TINY_MOE_WARM, ensure_quickstart_artifacts
    from rl_core.config import load_config
    from rl_core.model.loading import model_problem
    from rl_core.preflight.machine import machine_problems

    repo = Path(__file__).resolve().parents[2]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["moe_warm_start"]["steps"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(repo / "recipes" / "moe_arithmetic.py"), [])
    assert not [p for p in machine_problems(cfg) if "model.name_or_path" in p]  # missing, but built by the run
    assert ensure_quickstart_artifacts(cfg, announce=lambda _: None) == ["arithmetic_data", "tiny_moe_model",
                                                                        "moe_warm_start"]
    assert model_problem(TINY_MOE_INIT) is None and model_problem(TINY_MOE_WARM) is None
    config = json.loads((TINY_MOE_WARM / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (params["tiny_moe_model"]["experts"],
                                                                            params["tiny_moe_model"]["top_k"])
    assert ensure_quickstart_artifacts(cfg, announce=lambda _: None) == []  # whole: nothing rebuilt


def test_gradient_checkpointing_recomputes_under_the_replayed_routes(moe_dir):
    """A layer recomputed in backward (model.gradient_checkpointing) runs outside the caller's routing context; it
    must still use the replayed routes, or the gradient is that of another network: on the near-tie batch the
    gradients with checkpointing equal those without."""
    import copy

    from rl_core.model.protocol import enable_gradient_checkpointing

    model, tokenizer = load(moe_dir)
    c = sample(near_tie(model), tokenizer)
    grads = []
    for checkpointed in (False, True):
        m = copy.deepcopy(model)
        if checkpointed:
            enable_gradient_checkpointing(m)
        m.train()
        with routing.replaying(m, c.routes):
            lp = sequence_token_logprobs(m, c.input_ids, c.attention_mask, temperature=1.0, loss_mask=c.response_mask)
        lp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
    assert worst <= 1e-5, worst
