"""`posttrain export RUN [--step N] [--to DIR] [--merged] [--overwrite] [--trust-remote-code]`: a step's checkpoint as a transformers
directory (`infra.checkpoints.export`), loadable with `from_pretrained`, vLLM `--model DIR` or lm-eval `pretrained=DIR`."""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  posttrain export runs/arithmetic --step 200          # -> runs/arithmetic/export/step-200
  posttrain export arithmetic --to /models/arith       # the newest checkpoint of runs/arithmetic
  posttrain export runs/own-data-lora --merged         # LoRA: the merged model instead of the adapter

then: AutoModelForCausalLM.from_pretrained(DIR), vllm serve DIR, lm_eval --model hf --model_args pretrained=DIR
(LoRA adapter: peft.PeftModel.from_pretrained(base, DIR)); docs/checkpoints.md"""


def cmd_export(args: argparse.Namespace) -> int:
    from infra.checkpoints.export import ExportError, export_checkpoint
    from rl_core.redact import redact_message

    try:
        done = export_checkpoint(args.run, args.step, args.to, merged=args.merged, overwrite=args.overwrite,
                                 trust_remote_code=args.trust_remote_code)
    except ExportError as exc:
        print(f"posttrain export: {redact_message(str(exc))}", file=sys.stderr)
        return 1
    what = {"model": "model", "adapter": "LoRA adapter (PEFT)", "merged": "merged LoRA model"}[done.form]
    print(f"exported step {done.step} ({what}) to {done.path}")
    return 0


def add_export_command(subparsers) -> None:
    """Register `export` on `subparsers`."""
    p = subparsers.add_parser(
        "export", help="write a step's checkpoint as a transformers directory (from_pretrained, vLLM, lm-eval)",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run directory (runs/<job.name>) or a job name")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument("--to", default=None, help="the directory to write (default: RUN/export/step-<N>)")
    p.add_argument("--merged", action="store_true", help="LoRA runs: the merged model instead of the adapter")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --to directory (never the run directory or one inside it)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the base model's own code (auto_map in its config.json) run; a checkpoint cannot ask "
                        "for it")
    p.set_defaults(handler=cmd_export)
