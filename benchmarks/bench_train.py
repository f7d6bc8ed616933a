"""One train step on a GSM8K-shaped batch: the padded forward, the unpadded one, and TRL's GRPO loss.

The batch: `--prompts` GSM8K questions from the project's data (`data/gsm8k/train.jsonl`, built by
`dvc repro pipelines/gsm8k/dvc.yaml`), `--n` completions each. A prompt's length is its `plain_prompt`
text in characters / 4 (about what a BPE tokenizer such as Qwen's gives for English; no tokenizer can
be downloaded here); response lengths are drawn from a long-tailed log-normal (median 200 tokens,
sigma 0.8), clipped to [50, 1024]. Token ids are random. The model: a randomly initialised Qwen2
architecture with Qwen2.5's vocabulary size (151,936) and tied embeddings, `--hidden` wide and `--layers`
deep so that a step runs on 2 cores.

Rows (each in its own process, so that its peak memory is its own):
- `padded`: posttrain's `LLMTrainer` with the padded layout (`forward_layout("padded")`): every row
  at the batch's full width, `[rows, T, V]` logits and a float32 log-softmax over every position;
  `--micro` rows per micro-batch.
- `unpadded`: the default layout (real tokens only, logits of the loss tokens only), `--micro` rows.
- `unpadded-budget`: the same with `rl.micro_batch_max_tokens=--budget` (rows grouped by length).
- `trl`: TRL 1.16's `GRPOTrainer._compute_loss` (its fused LM head, loss_type dapo = token-mean) on the
  same model and rows, `--micro` rows per backward, then the same AdamW step (needs the `bench` extra).

Each prints useful tokens/s (loss tokens of the batch / median seconds of `--repeats` steps, the first
one excluded) and the peak memory of one step (the process's peak RSS during its first step less its
RSS before it: on CPU the tensors' bytes). GRPO objective, token-mean, on-policy, float32.

    python benchmarks/bench_train.py [--prompts 2] [--n 8] [--micro 4] [--budget 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
VOCAB = 151936
MAX_TOKENS = 1024
VARIANTS = ("padded", "unpadded", "unpadded-budget", "trl")


def lengths(args) -> tuple[list[int], list[int]]:
    """`(prompt lengths, response lengths)` of every row (prompt i's n rows share its prompt)."""
    import numpy as np

    from rl_core.data.gsm8k import plain_prompt, read_gsm8k_jsonl

    path = REPO / args.data
    if not path.is_file():
        print(f"{path} not found: build the project's GSM8K data with `dvc repro pipelines/gsm8k/dvc.yaml` "
              "(params.yaml gsm8k_data.source) or pass --data PATH", file=sys.stderr)
        sys.exit(2)
    records = read_gsm8k_jsonl(path)
    rng = np.random.default_rng(args.seed)
    picked = rng.choice(len(records), size=args.prompts, replace=False)
    prompts = [max(1, round(len(plain_prompt(records[i]["question"])) / 4)) for i in picked]
    responses = np.clip(np.round(rng.lognormal(math.log(200), 0.8, size=args.prompts * args.n)), 50, MAX_TOKENS)
    return [p for p in prompts for _ in range(args.n)], [int(r) for r in responses]


def build(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM


    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
    ).float()
    model.config._attn_implementation = "sdpa"
    prompt_len, resp_len = lengths(args)
    return model, random_batch(prompt_len, resp_len, VOCAB, args.n, args.seed)


def random_batch(prompt_len: list[int], resp_len: list[int], vocab: int, n: int, seed: int):
    """A GRPO `Trajectory` of random token ids: row i a left-padded prompt of `prompt_len[i]` tokens and a response
    of `resp_len[i]` loss tokens, groups of `n` rows, rewards 0 or 1 and their group advantages (benchmarks/gpu_check.py
    uses it too)."""
    import torch

    from rl_core.annotators.advantage import group_advantages
    from rl_core.batch.trajectory import Trajectory

    b, p, r = len(resp_len), max(prompt_len), max(resp_len)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(b, p + r, dtype=torch.long)
    att = torch.zeros(b, p + r, dtype=torch.long)
    loss = torch.zeros(b, p + r)
    for i, (n_p, n_r) in enumerate(zip(prompt_len, resp_len)):
        ids[i, p - n_p:p + n_r] = torch.randint(1, vocab, (n_p + n_r,), generator=g)
        att[i, p - n_p:p + n_r] = 1
        loss[i, p:p + n_r] = 1
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    groups = torch.arange(b) // n
    return Trajectory(ids, att, loss, torch.zeros(b, p + r), rewards, groups, torch.arange(b), 0,
                      advantages=group_advantages(rewards, groups))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def posttrain_step(args, model, batch, variant):
    import contextlib

    from rl_core.algorithms.context import ObjectiveContext
    from rl_core.algorithms.grpo import build_objective
    from rl_core.config import OptimizerConfig, RLConfig
    from rl_core.primitives.logprobs import forward_layout
    from rl_core.training.trainer import LLMTrainer

    trainer = LLMTrainer(model, build_objective(RLConfig(), ObjectiveContext(MAX_TOKENS)),
                         OptimizerConfig(lr=1e-6))
    def layout():
        return forward_layout("padded") if variant == "padded" else contextlib.nullcontext()

    budget = args.budget if variant == "unpadded-budget" else None
    micro = None if budget else args.micro

    def step():
        with layout():
            trainer.train_step(batch, micro, None, budget)
        trainer.release_gradients()

    return step


def trl_step(args, model, batch):
    import tempfile

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    p = int((batch.loss_mask.cumsum(-1) == 0).all(0).sum())  # prompt columns (left-padded prompts end here)
    inputs = {"prompt_ids": batch.input_ids[:, :p], "prompt_mask": batch.attention_mask[:, :p],
              "completion_ids": batch.input_ids[:, p:], "completion_mask": batch.attention_mask[:, p:],
              "advantages": batch.advantages}
    out = tempfile.mkdtemp(prefix="bench-train-trl-")
    config = GRPOConfig(output_dir=out, report_to=[], save_strategy="no", disable_tqdm=True, log_level="warning",
                        use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=batch.batch_size,
                        gradient_accumulation_steps=1, num_generations=args.n, max_completion_length=MAX_TOKENS,
                        beta=0.0, loss_type="dapo", learning_rate=1e-6, max_grad_norm=1.0)
    from rl_core.model.loading import build_tiny_tokenizer

    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=config,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * args.n),
                          processing_class=build_tiny_tokenizer())  # not used: the batch is token ids
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tokens = float(batch.loss_mask.sum())

    def step():
        optimizer.zero_grad(set_to_none=True)
        for s in range(0, batch.batch_size, args.micro):
            chunk = {k: v[s:s + args.micro] for k, v in inputs.items()}
            # dapo normalises by the batch's loss tokens: each chunk's loss is its numerator / all of them
            chunk["num_items_in_batch"] = torch.tensor(tokens)
            trainer._compute_loss(trainer.model, chunk).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_variant(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, batch = build(args)
    step = trl_step(args, model, batch) if args.variant == "trl" else posttrain_step(args, model, batch, args.variant)
    before = rss_bytes()
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    seconds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t)
    loss_tokens = int(batch.loss_mask.sum())
    median = statistics.median(seconds)
    return {"variant": args.variant, "rows": batch.batch_size, "width": batch.seq_len,
            "real_tokens": int(batch.attention_mask.sum()), "loss_tokens": loss_tokens, "first_s": first,
            "step_s": median, "tokens_per_s": loss_tokens / median, "peak_bytes": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/gsm8k/train.jsonl")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch (padded, unpadded, trl)")
    ap.add_argument("--budget", type=int, default=2048, help="rl.micro_batch_max_tokens of unpadded-budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", choices=VARIANTS, help="run one row in this process (used by the driver)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    import importlib.util

    rows = []
    passed = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("variant", "json")]
    for variant in VARIANTS:
        if variant == "trl" and importlib.util.find_spec("trl") is None:
            print("trl: skipped (pip install -e '.[bench]')")
            continue
        proc = subprocess.run([sys.executable, __file__, *passed, "--variant", variant], capture_output=True,
                              text=True, cwd=REPO, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stdout + proc.stderr[-4000:])
            return proc.returncode
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {rows[-1]['step_s']:.2f} s a step", file=sys.stderr, flush=True)
    first = rows[0]
    print(f"batch: {first['rows']} rows ({args.prompts} GSM8K prompts x {args.n}), padded width {first['width']}, "
          f"{first['real_tokens']} real tokens, {first['loss_tokens']} loss tokens; Qwen2 vocab {VOCAB}, hidden "
          f"{args.hidden}, {args.layers} layers, {args.threads} threads")
    print(f"{'variant':<17}{'step s':>9}{'loss tok/s':>12}{'peak MiB':>10}{'tok/s vs padded':>17}{'peak vs padded':>16}")
    base = rows[0]
    for r in rows:
        print(f"{r['variant']:<17}{r['step_s']:>9.2f}{r['tokens_per_s']:>12.0f}{r['peak_bytes'] / 2**20:>10.0f}"
              f"{r['tokens_per_s'] / base['tokens_per_s']:>16.2f}x{r['peak_bytes'] / base['peak_bytes']:>15.2f}x")
    by = {r["variant"]: r for r in rows}
    if "trl" in by:
        for v in ("unpadded", "unpadded-budget"):
            print(f"{v} vs trl: {by[v]['tokens_per_s'] / by['trl']['tokens_per_s']:.2f}x tokens/s, "
                  f"{by[v]['peak_bytes'] / by['trl']['peak_bytes']:.2f}x peak memory")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    report(args, rows)
    return 0


LABELS = {  # the section's names of VARIANTS
    "padded": "`padded` (every row at full width, `[rows, T, V]` float32 log-softmax)",
    "unpadded": "`unpadded` (real tokens, fused LM head on the loss tokens)",
    "unpadded-budget": "`unpadded-budget` (`rl.micro_batch_max_tokens={budget}`)",
    "trl": "`trl` (TRL {trl} `GRPOTrainer._compute_loss`, fused LM head)",
}


def report(args, rows: list[dict]) -> None:
    """docs/benchmarks.md's section: the table printed above, with the batch and the versions as notes."""
    import importlib.metadata

    from report import write_section  # benchmarks/ is this script's sys.path[0]

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    base, first = rows[0], rows[0]
    table = [[LABELS[r["variant"]].format(budget=args.budget, trl=version("trl")), f"{r['step_s']:.2f}",
              f"{r['tokens_per_s']:,.0f}", f"{r['peak_bytes'] / 2**20:,.0f}",
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×", f"{r['peak_bytes'] / base['peak_bytes']:.2f}×"]
             for r in rows]
    notes = [(f"The batch: {first['rows']} rows ({args.prompts} GSM8K prompts × {args.n}), {first['width']} columns "
             f"when padded, {first['real_tokens']:,} real tokens, {first['loss_tokens']:,} loss tokens; Qwen2 "
             f"vocabulary {VOCAB:,}, hidden {args.hidden}, {args.layers} layers, {args.threads} torch threads; "
             f"torch {version('torch')}, transformers {version('transformers')}.")]
    by = {r["variant"]: r for r in rows}
    if "trl" in by and "unpadded" in by:
        notes.append(f"`unpadded` against TRL: {by['unpadded']['tokens_per_s'] / by['trl']['tokens_per_s']:.2f}× the "
                     f"loss tokens per second at {by['unpadded']['peak_bytes'] / by['trl']['peak_bytes']:.2f}× the "
                     "peak memory.")
    write_section("train", ["variant", "s / step", "loss tokens / s", "peak MiB", "tokens/s vs padded",
                            "peak vs padded"], table, notes)


if __name__ == "__main__":
    sys.exit(main())
