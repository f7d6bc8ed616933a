"""`posttrain init-model | warm-start | make-data`: build the tiny model and the datasets (what DVC runs), and write a
verifiers environment's rows (`make-data verifiers`).

Default paths used by the recipes: `artifacts/tiny-model/init` (random init),
`artifacts/tiny-model/warm` (warm-started), `data/arithmetic/{train,val}.jsonl`,
`data/gsm8k/{train,test}.jsonl`, DPO pairs `data/arithmetic-pairs/{train,val}.jsonl`, the arithmetic judge's rows
`data/arithmetic-judge/{train,val}.jsonl`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TINY_INIT_DIR = "artifacts/tiny-model/init"
TINY_WARM_DIR = "artifacts/tiny-model/warm"
ARITHMETIC_DIR = "data/arithmetic"
ARITHMETIC_PAIRS_DIR = "data/arithmetic-pairs"
ARITHMETIC_RM_PAIRS_DIR = "data/arithmetic-rm-pairs"
ARITHMETIC_JUDGE_DIR = "data/arithmetic-judge"
GSM8K_DIR = "data/gsm8k"


def cmd_init_model(args: argparse.Namespace) -> int:
    from rl_core.model.loading import build_tiny_model, build_tiny_moe_model, count_parameters

    if args.experts:
        out = build_tiny_moe_model(args.out, seed=args.seed, experts=args.experts, top_k=args.top_k)
        what = f"tiny Mixtral, {args.experts} experts, top-{args.top_k}"
    else:
        out, what = build_tiny_model(args.out, seed=args.seed), "tiny Llama"
    from transformers import AutoModelForCausalLM

    n_params = count_parameters(AutoModelForCausalLM.from_pretrained(out))
    print(f"init-model: {what} ({n_params:,} parameters, seed {args.seed}) saved to {out}")
    return 0


def cmd_warm_start(args: argparse.Namespace) -> int:
    from rl_core.training.warm_start import progress_lines, warm_start, warm_start_chats

    progress = progress_lines(args.steps, lambda line: print(line, flush=True))
    if args.chats:
        template = Path(args.chat_template).read_text() if args.chat_template else None
        m = warm_start_chats(args.init, args.train, args.val, args.out, steps=args.steps, lr=args.lr,
                             batch_size=args.batch_size, seed=args.seed, chat_template=template, progress=progress)
        print(f"warm-start: {m['steps']} steps in {m['time_s']:.1f}s on {m['n_train']} conversations, loss "
              f"{m['final_loss']:.3f}, held-out loss on the assistant turns {m['val_loss_before']:.3f} -> "
              f"{m['val_loss']:.3f} (n={m['n_val']}); saved to {m['out_dir']}")
        return 0
    m = warm_start(
        args.init,
        args.train,
        args.val,
        args.out,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=progress,
    )
    print(
        f"warm-start: {m['steps']} steps in {m['time_s']:.1f}s, loss {m['final_loss']:.3f}, held-out greedy "
        f"accuracy {m['val_accuracy_before']:.3f} -> {m['val_accuracy']:.3f} (n={m['n_val']}); saved to {m['out_dir']}"
    )
    return 0


def cmd_make_arithmetic(args: argparse.Namespace) -> int:
    from rl_core.data import make_arithmetic_data

    ops = tuple(args.operators)
    r = make_arithmetic_data(
        args.out,
        seed=args.seed,
        low=args.low,
        high=args.high,
        operators=ops,
        val_size=args.val_size,
        train_size=args.train_size,
    )
    print(f"make-data arithmetic: {r['n_train']} train -> {r['train']}, {r['n_val']} held-out -> {r['val']}")
    return 0


def cmd_make_arithmetic_pairs(args: argparse.Namespace) -> int:
    from infra.artifacts import make_arithmetic_pair_splits

    r = make_arithmetic_pair_splits(args.data, args.out, seed=args.seed, max_pairs=args.max_pairs,
                                    max_val_pairs=args.max_val_pairs, model_dir=args.model, samples=args.samples)
    print(f"make-data arithmetic-pairs: {r['n_train']} train pairs -> {r['train']}, {r['n_val']} held-out pairs -> "
          f"{r['val']}")
    return 0


def cmd_make_arithmetic_judge(args: argparse.Namespace) -> int:
    from rl_core.data.pair_building import make_judge_rows

    pairs, out = Path(args.pairs), Path(args.out)
    made = {split: make_judge_rows(pairs / f"{split}.jsonl", out / f"{split}.jsonl", template=args.template)
            for split in ("train", "val")}
    print("make-data arithmetic-judge: " + ", ".join(f"{m['n_rows']} {split} rows -> {m['path']}"
                                                     for split, m in made.items()))
    return 0


def cmd_make_gsm8k(args: argparse.Namespace) -> int:
    from rl_core.data import prepare_gsm8k

    r = prepare_gsm8k(args.source, args.out)
    print(f"make-data gsm8k: {r['n_train']} train -> {r['train']}, {r['n_test']} test -> {r['test']}")
    return 0


def cmd_make_verifiers(args: argparse.Namespace) -> int:
    import json

    from rl_core.agents.verifiers import verifiers_rows

    try:
        env_args = json.loads(args.env_args)
    except ValueError:
        env_args = None
    if not isinstance(env_args, dict):
        print(f"posttrain make-data verifiers: --env-args {args.env_args!r} is not a JSON object, e.g. "
              f"'{{\"difficulty\": 2}}'", file=sys.stderr)
        return 2
    for split, name, n in (("train", "train", args.n), ("eval", "val", args.val_n)):
        if n == 0:
            continue
        path = Path(args.out) / f"{name}.jsonl"
        try:
            count = verifiers_rows(args.env, path, split=split, n=n, env_args=env_args, python=args.python,
                                   pythonpath=args.pythonpath)
        except RuntimeError as exc:
            print(f"posttrain make-data verifiers: {exc}", file=sys.stderr)
            return 1
        print(f"make-data verifiers: {count} {split} rows of {args.env} -> {path}")
    return 0


def add_build_commands(subparsers) -> None:
    """Register `init-model`, `warm-start` and `make-data {arithmetic,arithmetic-pairs,arithmetic-judge,verifiers,gsm8k}`
    on `subparsers`."""
    from rl_core.rewards.arithmetic import JUDGE_TEMPLATE
    from rl_core.training.warm_start import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_STEPS

    p = subparsers.add_parser(
        "init-model", help="build the tiny Llama + char tokenizer deterministically from a seed"
    )
    p.add_argument("--out", default=TINY_INIT_DIR, help=f"output directory (default {TINY_INIT_DIR})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=0,
                   help="a mixture-of-experts model (Mixtral) with this many experts per layer (default 0: dense)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token of the mixture-of-experts model")
    p.set_defaults(handler=cmd_init_model)

    p = subparsers.add_parser("warm-start", help="next-token training of the tiny model to a partial skill")
    p.add_argument("--init", default=TINY_INIT_DIR, help=f"model to start from (default {TINY_INIT_DIR})")
    p.add_argument("--train", default=f"{ARITHMETIC_DIR}/train.jsonl")
    p.add_argument("--val", default=f"{ARITHMETIC_DIR}/val.jsonl")
    p.add_argument("--out", default=TINY_WARM_DIR, help=f"output directory (default {TINY_WARM_DIR})")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chats", action="store_true",
                   help='--train/--val are JSONL conversations {"messages": [...]}: learn their assistant turns '
                        "(an agent task's format)")
    p.add_argument("--chat-template", help="with --chats: a Jinja chat template file that replaces the model's "
                                           "(saved with it), e.g. one that renders tools")
    p.set_defaults(handler=cmd_warm_start)

    p = subparsers.add_parser(
        "make-data", help="build a dataset: arithmetic (generated) or gsm8k (official JSONL / hub)"
    )
    kinds = p.add_subparsers(dest="dataset", required=True)
    a = kinds.add_parser("arithmetic", help="a<op>b= problems, seeded train/held-out split")
    a.add_argument("--out", default=ARITHMETIC_DIR)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--low", type=int, default=0, help="smallest operand")
    a.add_argument("--high", type=int, default=99, help="largest operand")
    a.add_argument("--operators", nargs="+", default=["+"], choices=["+", "-", "*"])
    a.add_argument("--val-size", type=int, default=500)
    a.add_argument("--train-size", type=int, default=None, help="default: every problem not held out")
    a.set_defaults(handler=cmd_make_arithmetic)
    pp = kinds.add_parser("arithmetic-pairs", help="DPO preference pairs (answer vs off-by-one digit) of both "
                          "arithmetic splits")
    pp.add_argument("--data", default=ARITHMETIC_DIR, help="directory with train.jsonl/val.jsonl")
    pp.add_argument("--out", default=ARITHMETIC_PAIRS_DIR, help="writes train.jsonl and val.jsonl here")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--max-pairs", type=int, default=None, help="keep the first N train pairs")
    pp.add_argument("--max-val-pairs", type=int, default=None, help="keep the first N held-out pairs")
    pp.add_argument("--model", default=None, help="rejected answers from this model's own wrong ones (its greedy "
                    "answer; with --samples, that many sampled per train prompt) instead of off-by-one digits")
    pp.add_argument("--samples", type=int, default=0, help="with --model: pairs per train prompt, one per answer "
                    "sampled at temperature 1 (a reward model's data)")
    pp.set_defaults(handler=cmd_make_arithmetic_pairs)
    j = kinds.add_parser("arithmetic-judge", help="a pointwise judge's rows (request -> verdict 1 or 0) of both "
                         "splits of arithmetic preference pairs")
    j.add_argument("--pairs", default=ARITHMETIC_RM_PAIRS_DIR, help="directory with the pairs' train.jsonl/val.jsonl "
                   f"(default {ARITHMETIC_RM_PAIRS_DIR}, the reward model's)")
    j.add_argument("--out", default=ARITHMETIC_JUDGE_DIR, help="writes train.jsonl and val.jsonl here")
    j.add_argument("--template", default=JUDGE_TEMPLATE, help="the judge's request with {prompt}, {completion} and "
                   "{answer}: the recipe's judge.template (default: recipes/judge_arithmetic.py's)")
    j.set_defaults(handler=cmd_make_arithmetic_judge)
    v = kinds.add_parser("verifiers", help="the rows of an environment written with verifiers, as it formats them "
                         "(docs/agents.md): its dataset to train.jsonl, its eval dataset to val.jsonl")
    v.add_argument("--env", required=True, help="the environment's id, as vf.load_environment takes it")
    v.add_argument("--env-args", default="{}", help="its load_environment arguments, a JSON object")
    v.add_argument("--out", required=True, help="writes train.jsonl and val.jsonl here")
    v.add_argument("--n", type=int, default=-1, help="the first N train rows (default: all)")
    v.add_argument("--val-n", type=int, default=-1, help="the first N eval rows (default: all; 0: no val.jsonl)")
    v.add_argument("--python", default=None, help="the Python that has verifiers (default: "
                   "$POSTTRAIN_VERIFIERS_PYTHON, else this one); `make verifiers-venv` builds .venv-verifiers")
    v.add_argument("--pythonpath", nargs="*", default=[], help="directories the environment is imported from")
    v.set_defaults(handler=cmd_make_verifiers)
    g = kinds.add_parser("gsm8k", help="official GSM8K JSONL from a directory, or a hub dataset id")
    g.add_argument(
        "--source",
        required=True,
        help="directory with train.jsonl/test.jsonl, or a hub id (needs 'datasets')",
    )
    g.add_argument("--out", default=GSM8K_DIR)
    g.set_defaults(handler=cmd_make_gsm8k)
