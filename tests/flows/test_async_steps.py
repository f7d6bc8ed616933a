"""`rl.async_steps`: the rollout of step k+1 overlapped with step k's training, end to end (real Prefect, real
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
ASYNC = [*CLIPPED, "cluster.placement=separate", "rollout.num_engines=1", "rl.async_steps=1"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_steps_trains_each_batch_one_version_stale_and_checkpoints_the_prompt_stream(in_workdir, warm_model):
    """Step 1 samples with version 0 and trains it on-policy (ρ = 1 exactly); every later step trains a batch
    that the engine sampled with the version before the trainer's (staleness 1, ρ ≠ 1: π_old is the behaviour
    policy), so step k+1's rollout ran on version k-1 while step k trained. The checkpoint of step 2 (written
    with step 3's rollout in flight) resumes the prompt stream at step 3."""
    from flows.grpo import grpo
    from infra.storage import CheckpointStore
    from rl_core.data import PromptSampler

    model = f"model.name_or_path={warm_model[0]}"
    grpo(recipe("arithmetic"), [*ASYNC, model, "rl.max_steps=4", "rl.save_every=2", "job.name=overlap"])
    whole = read_metrics(in_workdir / "runs" / "overlap")
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert [r["rollout/policy_staleness"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert [r["perf/policy_version"] for r in whole] == [1, 2, 3, 4]
    assert whole[0]["train/ratio_min"] == whole[0]["train/ratio_max"] == 1.0
    assert all(r["train/ratio_min"] < 1.0 < r["train/ratio_max"] for r in whole[1:])
    assert all(r["rollout/logp_abs_diff"] > 1e-4 for r in whole[1:])  # the engine sampled older weights

    # step 2's checkpoint was written with step 3's rollout in flight: its sampler is the one after step 2's draw,
    # so a resume from it draws step 3's prompts (not step 4's)
    parts, _ = CheckpointStore(in_workdir / "runs" / "overlap" / "checkpoints").load(2)
    sampler = PromptSampler(**{k: parts["driver"]["sampler"][k] for k in ("num_examples", "batch_size", "seed")})
    sampler.load_state_dict(parts["driver"]["sampler"])
    assert sampler.next_batch() == whole[2]["data/prompt_rows"]
    assert sampler.next_batch() == whole[3]["data/prompt_rows"] != whole[2]["data/prompt_rows"]


def test_with_the_option_off_the_trajectory_is_the_plain_on_policy_loop_bit_for_bit(in_workdir, warm_model):
    """rl.async_steps=0 (the default): every step samples with the weights the step before produced. The flow's
    losses and final weights equal those of that loop, written out here in-process with rl_core (one thread, as
    the trainer actor), bit for bit."""
    from flows.grpo import grpo
    from infra.engines import build_engine
    from infra.policy_worker import build_trainer
    from infra.roles import RolloutRole
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
