"""Chat benchmark: does a TRL-style conversational dataset learn on CPU? (recipes/chat_arithmetic.py)

Builds, in a scratch directory, what `dvc repro pipelines/chat_arithmetic/dvc.yaml` builds with params.yaml's
values (the TRL-format rows, and the chat warm start: the quickstart's warm start trained on conversations),
then runs the recipe (`posttrain run`: GRPO, 16 prompts x 16 completions a step, rewards accuracy 1.0 + format
0.2) and prints the held-out exact-answer accuracy (`val/accuracy`, the share of the 200 held-out
conversations whose `accuracy_reward` is 1) at every evaluation, and its rise. `--baseline` also runs the recipe
from the quickstart's warm start as it is (no chat warm start).

    python benchmarks/bench_chat.py [--steps 100] [--baseline]

The quickstart's tiny model and data are taken from the checkout when built (`make demo`, `dvc repro`), else
built there first, as `posttrain run recipes/arithmetic.py` builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench_pipeline import QUIET_ENV, posttrain_command  # benchmarks/ is this script's sys.path[0]
from report import write_section

REPO = Path(__file__).resolve().parents[1]


def build(workdir: Path) -> dict:
    """The chat rows and the chat warm start in `workdir`, with params.yaml's values; the warm start's figures."""
    from examples.chat_arithmetic import main as make_rows
    from infra.artifacts import ensure_quickstart_artifacts, load_params
    from rl_core.config import load_config
    from rl_core.training.warm_start import warm_start_chats

    os.chdir(REPO)
    ensure_quickstart_artifacts(load_config("recipes/arithmetic.py"))
    params = load_params(REPO / "params.yaml")
    make_rows(["--out", str(workdir / "data"), "--seed", str(params["chat_arithmetic"]["seed"])])
    return warm_start_chats(REPO / "artifacts/tiny-model/warm", workdir / "data/warm-train.jsonl",
                            workdir / "data/warm-val.jsonl", workdir / "chat-warm", **params["chat_warm_start"])


def run(workdir: Path, name: str, model: Path, steps: int) -> tuple[list[dict], float]:
    cmd = [*posttrain_command(), "run", str(REPO / "recipes" / "chat_arithmetic.py"), "--", f"job.name={name}",
           f"model.name_or_path={model}", f"data.train={workdir / 'data/train.jsonl'}",
           f"data.val={workdir / 'data/val.jsonl'}", f"rl.max_steps={steps}", "rl.save_every=0", "rl.resume=off",
           "job.overwrite=true"]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=workdir, env={**os.environ, **QUIET_ENV}, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("val/accuracy") is not None], wall


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--baseline", action="store_true", help="also run from the quickstart's warm start")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-chat-"))
    try:
        warm = build(workdir)
        starts = [("chat warm start", workdir / "chat-warm")]
        if args.baseline:
            starts.append(("quickstart warm start", REPO / "artifacts/tiny-model/warm"))
        results = [(label, *run(workdir, f"bench-chat-{i}", model, args.steps)) for i, (label, model) in
                   enumerate(starts)]
        header = ["model", *[f"step {r['step']}" for r in results[0][1]], "rise", "run wall s"]
        rows = []
        for label, evals, wall in results:
            accuracy = [r["val/accuracy"] for r in evals]
            rows.append([label, *[f"{a:.3f}" for a in accuracy], f"{accuracy[-1] - accuracy[0]:+.3f}", f"{wall:.0f}"])
        held_out = len((workdir / "data/val.jsonl").read_text().splitlines())
        notes = [(f"Held-out accuracy: the share of {held_out} held-out conversations answered exactly "
                  f"(`val/accuracy`, greedy); {args.steps} GRPO steps of 16 prompts x 16 completions."),
                 (f"Chat warm start: {warm['steps']} steps in {warm['time_s']:.1f} s, held-out loss on the answers "
                  f"{warm['val_loss_before']:.3f} -> {warm['val_loss']:.3f}.")]
        write_section("chat", header, rows, notes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
