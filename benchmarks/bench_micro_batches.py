"""A skewed batch: the train step's cost with no micro-batch option set, against the whole batch in one chunk.

The batch: 25 rows of a 16-token prompt; `short`: every response 16 tokens; `skewed`: 24 responses of 16 tokens and one
of 384 (1.5x the real tokens of `short`). The model: a randomly initialised Qwen2 architecture with Qwen2.5's
151,936-token vocabulary (`--hidden` wide, `--layers` deep: deep enough that the layers, which see the padding, and
not the LM head, which sees only the loss tokens, dominate a step), float32, GRPO token-mean, on-policy, through
`LLMTrainer.train_step` (the rows layout: a chunk is as wide as its longest row). Ways:

- `default`: no micro-batch option (`rl.micro_batch_per_replica` and `rl.micro_batch_max_tokens` unset): the whole
  batch while padding costs at most its real tokens, else rows grouped by length (`Trajectory.padding_budget`);
- `one chunk`: `micro_batch_size` = the batch's rows, every row as wide as the longest;
- `budget 1024`: `rl.micro_batch_max_tokens=1024`.

Printed: the median seconds of `--repeats` steps (after one warm-up) of each way on each batch, and each against the
`short` batch's `default` step. The loss of each way on the skewed batch is the same (TOKEN_SUM: any split).

    python benchmarks/bench_micro_batches.py [--hidden 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench_train import VOCAB, random_batch  # benchmarks/ is this script's sys.path[0]
from report import write_section

ROWS, PROMPT, SHORT, LONG = 25, 16, 16, 384
WAYS = {"default": (None, None), "one chunk": (ROWS, None), "budget 1024": (None, 1024)}  # (micro rows, budget)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.training.trainer import LLMTrainer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)).float()
    model.config._attn_implementation = "sdpa"
    trainer = LLMTrainer(model, build_objective(RLConfig(), ObjectiveContext(LONG)), OptimizerConfig(lr=1e-12))
    batches = {"short": random_batch([PROMPT] * ROWS, [SHORT] * ROWS, VOCAB, 5, 0),
               "skewed": random_batch([PROMPT] * ROWS, [SHORT] * (ROWS - 1) + [LONG], VOCAB, 5, 0)}
    seconds: dict[tuple[str, str], float] = {}
    losses: dict[str, list[float]] = {"skewed": []}
    for name, batch in batches.items():
        for way, (rows, budget) in WAYS.items():
            times = []
            for _ in range(args.repeats + 1):
                t = time.perf_counter()
                metrics = trainer.train_step(batch, rows, None, budget)
                times.append(time.perf_counter() - t)
            seconds[name, way] = statistics.median(times[1:])
            if name == "skewed":
                losses[name].append(metrics["train/loss"])
    base = seconds["short", "default"]
    header = ["batch", "real tokens", *[f"{w} s" for w in WAYS], *[f"{w} / short" for w in WAYS]]
    rows = []
    for name, batch in batches.items():
        real = int(batch.attention_mask.sum())
        rows.append([name, f"{real:,}", *[f"{seconds[name, w]:.3f}" for w in WAYS],
                     *[f"{seconds[name, w] / base:.2f}x" for w in WAYS]])
    spread = max(losses["skewed"]) - min(losses["skewed"])
    note = (f"Qwen2 {args.hidden} wide, {args.layers} layers, vocabulary {VOCAB:,}; float32; medians of {args.repeats} "
            f"steps after one warm-up; lr 1e-12, so every step sees the same weights to float precision. The skewed "
            f"batch's loss differs between the ways by {spread:.1e}.")
    write_section("micro-batches", header, rows, [note])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
