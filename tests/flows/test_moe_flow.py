"""A mixture-of-experts policy end to end (real Prefect, real local Ray, a separate HF engine): the engine's routes
travel with the batch from the engine actor through the driver, the gate and the trainer actor, and the trainer's
forwards replay them (recipes/moe_arithmetic.py, docs/moe.md)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import recipe
from tests.run_helpers import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_moe_grpo_replays_the_engines_routes_across_actors(in_workdir):
    """The tiny Mixtral with a near tie in every router (expert 1's router row expert 0's plus 1e-7 noise, routers
    sharpened): the trainer's own forward would send some tokens to other experts than the engine did
    (train/routing_replay_differ_frac > 0), yet with the engine's routes replayed the sampler/trainer gap of every
    step is float noise; the routes' size is logged per step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.grpo import grpo
    from rl_core.model import routing
    from rl_core.model.loading import build_tiny_moe_model

    init = build_tiny_moe_model(in_workdir / "artifacts" / "tiny-moe" / "near-tie-init", seed=0)
    model = AutoModelForCausalLM.from_pretrained(init)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight.mul_(50)
            r.weight[1] = r.weight[0] + 1e-7 * torch.randn(r.weight.shape[1], generator=gen)
    model.save_pretrained(init)
    AutoTokenizer.from_pretrained(init).save_pretrained(init)

    grpo(recipe("moe_arithmetic"), [f"model.name_or_path={init}", "rl.max_steps=2", "rollout.prompts_per_step=4",
                                    "rollout.n=4", "rollout.max_tokens=16", "rl.mini_batch_per_replica=16",
                                    "rl.validation.before_training=false", "rl.validation.every_steps=0",
                                    "rl.validation.max_prompts=8", "rl.save_every=0", "cluster.placement=separate",
                                    "rollout.num_engines=1", "job.name=moe"])
    records = read_metrics(in_workdir / "runs" / "moe")
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    for r in (r for r in records if "train/loss" in r):
        assert r["rollout/logp_abs_diff_max"] <= 1e-5, r  # one update per batch: the gap before it
        # 16 rows of a short sum's prompt + up to 16 response tokens, 4 layers x top-2 experts, a byte each
        assert 16 * 16 * 8 / 2**20 < r["rollout/routes_mb"] <= 16 * (16 + 16) * 8 / 2**20
    assert max(r["train/routing_replay_differ_frac"] for r in records if "train/loss" in r) > 0
