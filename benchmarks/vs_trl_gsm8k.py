"""GSM8K-shaped whole steps, posttrain against TRL's GRPOTrainer: `python benchmarks/bench_vs_trl.py --gsm8k`.

The model is bench_train.py's: a randomly initialised Qwen2 with Qwen2.5's vocabulary (151,936 tokens, tied
embeddings), `--hidden` wide and `--layers` deep, saved here with a byte-level BPE tokenizer of as many entries
(merges learnt from the GSM8K train questions, then filler tokens; no real tokenizer can be downloaded here), so a
GSM8K question is about as many tokens as Qwen's tokenizer makes of it. A random model samples to the length cap:
every completion is `--max-tokens` (512) tokens. A step: `--prompts` GSM8K questions (the project's
`data/gsm8k/train.jsonl`, plain prompts) x `--n` completions at temperature 1, rewarded by one deterministic
function of the text (`parity`: the parity of its characters' code points, so groups have non-zero
advantages), then one AdamW update of GRPO's token-mean loss with no KL, float32.

The runs, one after the other in one invocation:
- posttrain on-policy: colocated, one trainer rank with every core (`cluster.cpus_per_worker`), its HF engine
  sampling from the trainer's own weights;
- posttrain with `rl.async_steps=1` and `=2`: one separate HF engine (1 core) beside the trainer rank (the other
  cores), the rollouts of later steps in flight while a step trains;
- TRL's GRPOTrainer in this process (transformers' generate; torch's threads = every core).
Seconds per step: the median over steps 2..N of each step's wall time (posttrain: the loop's, metrics writing
included, `bench_pipeline.wall_per_step`; TRL: a callback's clock around each optimizer step, generation
included). Useful tokens/s: the completion tokens a step trains on / its seconds.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151936
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
REWARD_MODULE = "gsm8k_bench_reward"
REWARD_SOURCE = '''def parity(prompts, completions, **_):
    """1.0 when the code points of the completion's characters add up to an odd number, else 0.0."""
    return [float(sum(map(ord, text)) % 2) for text in completions]
'''
POSTTRAIN_MODES = {  # name -> (label, overrides)
    "posttrain-sync": ("posttrain, on-policy (colocated)", ["cluster.placement=colocated", "rl.async_steps=0"]),
    "posttrain-async1": ("posttrain, `rl.async_steps=1` (separate engine)",
                         ["cluster.placement=separate", "rollout.num_engines=1", "rl.async_steps=1"]),
    "posttrain-async2": ("posttrain, `rl.async_steps=2` (separate engine)",
                         ["cluster.placement=separate", "rollout.num_engines=1", "rl.async_steps=2"]),
}


def questions(data: Path, count: int, seed: int) -> tuple[list[str], list[str]]:
    """`(every train question's plain prompt, the first `count` of a seeded shuffle)`."""
    import random

    from rl_core.data.gsm8k import plain_prompt, read_gsm8k_jsonl

    prompts = [plain_prompt(r["question"]) for r in read_gsm8k_jsonl(data)]
    picked = list(prompts)
    random.Random(seed).shuffle(picked)
    return prompts, picked[:count]


def build_model(out: Path, corpus: list[str], hidden: int, layers: int, seed: int) -> Path:
    """The random Qwen2 and a byte-level BPE tokenizer (Qwen's kind) of `VOCAB` entries, saved to `out`: merges learnt
    from `corpus`, then filler tokens up to the vocabulary's size."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=32000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    vocab = dict(learner.get_vocab())
    learnt = len(vocab)
    vocab.update({f"<w{i}>": learnt + i for i in range(VOCAB - learnt)})
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(learner.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", padding_side="left",
                                        model_max_length=4096)
    assert len(tokenizer) == VOCAB, len(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"], bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"])).float()
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def run_posttrain(workdir: Path, name: str, model_dir: Path, data: Path, args, overrides: list[str]) -> dict:
    from bench_pipeline import QUIET_ENV, posttrain_command, wall_per_step  # benchmarks/ is sys.path[0]

    cores = os.cpu_count() or 1
    trainer_cpus = cores if "cluster.placement=colocated" in overrides else max(cores - 1, 1)
    run_overrides = [
        f"job.name=bench-{name}", f"job.seed={args.seed}", f"model.name_or_path={model_dir}",
        f"data.train={data / 'train.jsonl'}", f"data.val={data / 'test.jsonl'}", "data.prompt_template=plain",
        f"data.rewards=[{{path: '{REWARD_MODULE}:parity'}}]", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}", f"rollout.max_tokens={args.max_tokens}", "rollout.temperature=1.0",
        "rl.objective.type=grpo", "rl.objective.loss_type=token-mean", "rl.mini_batch_per_replica=null",
        f"rl.max_steps={args.steps}", "rl.validation.before_training=false", "rl.validation.every_steps=0",
        "rl.validation.max_prompts=1", "rl.save_every=0", "rl.resume=off", "job.overwrite=true",
        f"cluster.cpus_per_worker={trainer_cpus}", *overrides]
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join([str(workdir), str(REPO)])}
    log = workdir / f"{name}.log"
    started = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([*posttrain_command(), "run", str(REPO / "recipes" / "grpo_gsm8k_cpu.py"), "--",
                               *run_overrides], cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"posttrain ({name}) exited {proc.returncode}:\n{tail}")
    records = [json.loads(line) for line in (workdir / "runs" / f"bench-{name}" / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "perf/step_s" in r]
    rows = args.prompts * args.n
    return {"step_s": wall_per_step(workdir, f"bench-{name}", steps),
            "tokens": [r["rollout/response_len_mean"] * rows for r in steps],
            "generate_s": [r["perf/generate_s"] for r in steps],
            "train_s": [r["perf/train_compute_s"] for r in steps], "wall_s": time.perf_counter() - started,
            "threads": trainer_cpus}


def run_trl(workdir: Path, model_dir: Path, prompts: list[str], args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(workdir))
    reward = importlib.import_module(REWARD_MODULE).parity
    torch.set_num_threads(os.cpu_count() or 1)
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), report_to=[], save_strategy="no", disable_tqdm=True, log_level="warning",
        logging_steps=1, use_cpu=True, bf16=False, fp16=False, seed=args.seed, max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1, num_generations=args.n,
        num_iterations=1, shuffle_dataset=False, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0,
        top_k=0, learning_rate=1e-6, lr_scheduler_type="constant", beta=0.0, loss_type="dapo",
        dataloader_num_workers=0)
    step_s: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s.append(time.perf_counter() - self.mark)
            print(f"  trl step {state.global_step}: {step_s[-1]:.1f} s", flush=True)
            self.mark = time.perf_counter()

    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    started = time.perf_counter()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": step_s, "tokens": [length * args.prompts * args.n for length in lengths],
            "wall_s": time.perf_counter() - started, "threads": torch.get_num_threads()}


def main(args) -> int:
    import shutil
    import tempfile

    from report import write_section  # benchmarks/ is sys.path[0]

    data = REPO / "data" / "gsm8k"
    if not (data / "train.jsonl").is_file():
        print(f"{data / 'train.jsonl'} not found: build the project's GSM8K data with "
              "`dvc repro pipelines/gsm8k/dvc.yaml` (params.yaml gsm8k_data.source)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-bench-gsm8k-"))
    try:
        (workdir / f"{REWARD_MODULE}.py").write_text(REWARD_SOURCE)
        corpus, picked = questions(data / "train.jsonl", args.steps * args.prompts, args.seed)
        model_dir = build_model(workdir / "model", corpus, args.hidden, args.layers, args.seed)
        results: dict[str, dict] = {}
        for name, (_, overrides) in POSTTRAIN_MODES.items():
            print(f"== {name}", flush=True)
            results[name] = run_posttrain(workdir, name, model_dir, data, args, overrides)
        print("== trl", flush=True)
        results["trl"] = run_trl(workdir, model_dir, picked, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    labels = {**{k: v[0] for k, v in POSTTRAIN_MODES.items()}, "trl": "TRL GRPOTrainer"}
    header = ["system", "s / step", "useful tokens / s", "vs TRL (tokens/s)", "inside generate s", "inside fwd/bwd s",
              "threads"]

    def steady(values: list[float]) -> float:
        """The median over steps 2..N (the first warms up)."""
        return statistics.median(values[1:] if len(values) > 1 else values)

    seconds = {name: steady(r["step_s"]) for name, r in results.items()}
    rates = {name: steady(r["tokens"]) / seconds[name] for name, r in results.items()}
    rows = []
    for name in ["trl", *POSTTRAIN_MODES]:
        r = results[name]
        rows.append([labels[name], f"{seconds[name]:.1f}", f"{rates[name]:.0f}", f"{rates[name] / rates['trl']:.2f}×",
                     f"{steady(r['generate_s']):.1f}" if "generate_s" in r else "–",
                     f"{steady(r['train_s']):.1f}" if "train_s" in r else "–", str(r["threads"])])
        print(" | ".join(rows[-1]), flush=True)
    notes = [(f"{args.prompts} GSM8K prompts × {args.n} completions of {args.max_tokens} tokens a step; Qwen2 "
              f"vocabulary {VOCAB:,}, hidden {args.hidden}, {args.layers} layers, float32; {args.steps} steps each, "
              f"medians over steps 2..{args.steps}; TRL loss_type dapo (token-mean), posttrain GRPO token-mean, one "
              "update per batch, no KL."),
             ("`threads`: the trainer's torch threads. With a separate engine the cores are split between the engine "
              "and the trainer, so generation and training each run on fewer cores while they overlap.")]
    write_section("vs-trl-gsm8k", header, rows, notes)
    return 0
