"""Every GSM8K recipe runs end to end on CPU (tiny model, a few problems): every phase runs and is logged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import recipe

pytestmark = pytest.mark.e2e  # whole flows on the GSM8K CPU recipes

PROBLEMS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 2 boxes?", "answer": "12*2=<<12*2=24>>24\n#### 24"},
    {"question": "Sara had $50 and spent $15. How much is left?", "answer": "50-15=<<50-15=35>>35\n#### 35"},
    {"question": "There are 9 birds; 4 fly away. How many remain?", "answer": "9-4=<<9-4=5>>5\n#### 5"},
]


@pytest.fixture
def gsm8k_files(in_workdir):
    root = in_workdir / "gsm8k-fixture"
    root.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_gsm8k_cpu", "dr_grpo_gsm8k_cpu", "gspo_gsm8k_cpu"])
def test_gsm8k_cpu_recipe_runs_every_phase(name, gsm8k_files, in_workdir):
    from flows.grpo import grpo
    from rl_core.config import load_config

    overrides = [f"data.train={gsm8k_files / 'train.jsonl'}", f"data.val={gsm8k_files / 'test.jsonl'}",
                 "model.name_or_path=artifacts/tiny-model/init", "rl.max_steps=1"]
    cfg = load_config(recipe(name), overrides)
    result = grpo(recipe(name), overrides)
    records = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    step = records[1]
    assert math.isfinite(step["train/loss"]) and math.isfinite(step["train/grad_norm"])
    assert step["rollout/response_len_max"] <= cfg.rollout.max_tokens
    assert records[0]["val/n"] == len(PROBLEMS)
    if cfg.rl.objective.reads_old_logp:
        assert "train/clip_frac" in step and "train/ratio_mean" in step
    assert (in_workdir / cfg.run_dir / "checkpoints").is_dir()
