"""Warm start: plain next-token training of the tiny model on `prompt + answer + <eos>`.

RL from a random init barely learns two-digit addition, so the policy first gets a partial skill
by supervised training on the train split, stopped early on purpose: the defaults (800 steps of
32 examples, AdamW lr 1e-3) leave held-out greedy accuracy well below 1 (0.72-0.80 for seed 0,
depending on the CPU's float kernels), so RL has real work left; from a start near 0.5 the
quickstart's legacy policy gradient plateaus below 0.9 (docs/quickstart.md).

Loss: next-token cross-entropy on the sequence `prompt + answer + <eos>`, counted on the answer
tokens and `<eos>` only. The prompt tokens are fed but not scored: their operands are uniformly
random digits, so scoring them only adds irreducible loss and gradient noise (with the loss on
all tokens the same budget reached ~0.05 accuracy instead of ~0.5).

Deterministic given the seed (init snapshot, data order from `PromptSampler(seed)`, no dropout) and the CPU's
float kernels: it trains on `WARM_START_THREADS` torch threads whatever the process's own count, so `dvc repro`,
`posttrain run` (which builds a missing warm start in its driver) and the tests build the same bytes on machines
with any number of cores. The saved snapshot is what RL results depend on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from rl_core.atomic import atomic_directory
from rl_core.data import PromptSampler
from rl_core.evaluation.heldout import evaluate_accuracy
from rl_core.tasks import format_prompt, get_task, load_examples

DEFAULT_STEPS = 800
WARM_START_THREADS = 1  # a reduction split over threads sums in another order: the bytes depend on the count
DEFAULT_LR = 1e-3
DEFAULT_BATCH_SIZE = 32


def encode_supervised_batch(
    tokenizer, examples, task: str = "arithmetic"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, labels)` `[B, T]` for `prompt + answer + <eos>`, right-padded.

    The prompt is tokenised exactly as the rollout sees it (plain template, the tokenizer's
    special tokens); labels are -100 on prompt tokens and padding (right padding keeps positions
    0..len-1, so no position ids are needed).
    """
    seqs, targets = [], []
    for ex in examples:
        prompt = list(tokenizer(format_prompt(ex, tokenizer, task, "plain"))["input_ids"])
        answer = list(tokenizer(get_task(task).supervised_target(ex), add_special_tokens=False)["input_ids"])
        seqs.append(prompt + answer + [tokenizer.eos_token_id])
        targets.append([-100] * len(prompt) + answer + [tokenizer.eos_token_id])
    return _right_padded(tokenizer, seqs, targets)


def _right_padded(tokenizer, seqs: list[list[int]], targets: list[list[int]]):
    """`(input_ids, attention_mask, labels)` `[B, T]` of token lists and their labels (-100: not learned), padded on
    the right with the pad id (labels -100)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (seq, target) in enumerate(zip(seqs, targets, strict=True)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, :len(target)] = torch.tensor(target)
    return ids, mask, labels


def warm_start(init_dir: str | Path, train_path: str | Path, val_path: str | Path, out_dir: str | Path,
               **options) -> dict:
    """Train `init_dir`'s model for `steps` AdamW steps on `WARM_START_THREADS` threads, save model+tokenizer to
    `out_dir`, return metrics (`_train_warm_start`: the options and metrics). The process's thread count is put back
    afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_START_THREADS)
    try:
        return _train_warm_start(init_dir, train_path, val_path, out_dir, **options)
    finally:
        torch.set_num_threads(threads)


def _train_warm_start(
    init_dir: str | Path,
    train_path: str | Path,
    val_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    task: str = "arithmetic",
    max_eval_tokens: int = 4,
    max_val_examples: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict:
    """Train `init_dir`'s model for `steps` AdamW steps, save model+tokenizer to `out_dir`, return metrics.

    The model is trained on CPU in float32 wherever it is loaded; `progress(step, loss)` is called after every step
    (`progress_lines`). Metrics: `steps`, `final_loss` (mean of the last 10 steps), `val_accuracy_before`,
    `val_accuracy` (held-out greedy exact match after training), `n_train`, `n_val`, `time_s`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    train = load_examples(train_path, task)
    val = load_examples(val_path, task)
    if max_val_examples is not None:
        val = val[:max_val_examples]
    eval_kwargs = {"task": task, "max_tokens": max_eval_tokens}
    before = evaluate_accuracy(model, tokenizer, val, **eval_kwargs)

    losses = _fit(model, lambda rows: encode_supervised_batch(tokenizer, [train[i] for i in rows], task), len(train),
                  steps=steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress)
    after = evaluate_accuracy(model, tokenizer, val, **eval_kwargs)
    out = _save(model, tokenizer, out_dir)
    tail = losses[-10:]
    return {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "val_accuracy_before": before["accuracy"],
        "val_accuracy": after["accuracy"],
        "val_samples": after["samples"],
        "n_train": len(train),
        "n_val": len(val),
        "time_s": time.perf_counter() - started,
        "out_dir": str(out),
    }


def _fit(model, encode, rows: int, *, steps: int, lr: float, batch_size: int, seed: int,
         progress: Callable[[int, float], None] | None = None) -> list[float]:
    """`steps` AdamW steps (gradient norm clipped at 1) on batches `encode(row indices)` drawn by
    `PromptSampler(rows, batch_size, seed)`, `progress(step, loss)` after each; returns each step's loss. Leaves the
    model in eval mode."""
    sampler = PromptSampler(rows, batch_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for step in range(1, steps + 1):
        ids, mask, labels = encode(sampler.next_batch())
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    model.eval()
    return losses


def progress_lines(steps: int, say: Callable[[str], None] = print, *, what: str = "warm-start",
                   every_s: float = 15.0) -> Callable[[int, float], None]:
    """A `progress(step, loss)` for a warm start of `steps` steps that says a line at every tenth of them and at
    least every `every_s` seconds: the step, the mean loss since the last line, the seconds so far and an estimate
    of those left."""
    started = last = time.perf_counter()
    tenth = max(1, steps // 10)
    window: list[float] = []

    def progress(step: int, loss: float) -> None:
        nonlocal last
        window.append(loss)
        now = time.perf_counter()
        if step % tenth and step != steps and now - last < every_s:
            return
        elapsed = now - started
        left = elapsed / step * (steps - step)
        say(f"{what}: step {step}/{steps} ({100 * step // steps}%), loss {sum(window) / len(window):.3f}, "
            f"{elapsed:.0f} s so far, about {left:.0f} s left")
        window.clear()
        last = now

    return progress


def _save(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    with atomic_directory(out) as tmp:  # a reader never sees half a model
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


# ------------------------------------------------------------------------------------- chat transcripts

def encode_chat_batch(tokenizer, conversations) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, labels)` `[B, T]`, right-padded, for whole conversations (`{"messages": [...],
    "tools": [JSON schemas] (optional)}`, TRL's conversational rows) laid out as an agent episode is
    (`rl_core.agents.Episode`): the messages before the first assistant turn rendered with the chat template, the
    tools and its generation prompt, then each assistant turn's text and the end-of-turn token (`<eos>`), each
    followed by the template's delta for the messages up to the next assistant turn. Labels are on the assistant
    turns only (their text and `<eos>`): the model learns to act, not to write the environment's replies."""
    from rl_core.agents.episode import template_delta

    stop = tokenizer.decode([tokenizer.eos_token_id])
    seqs, targets = [], []
    for c, row in enumerate(conversations):
        messages, tools = row["messages"], row.get("tools") or None
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError(f"conversation {c}: needs opening messages and then at least one assistant turn")
        ids = list(tokenizer.apply_chat_template(list(messages[:first]), tools=tools, add_generation_prompt=True,
                                                 tokenize=True)["input_ids"])
        labels = [-100] * len(ids)
        i = first
        while i < len(messages):
            turn = list(tokenizer(messages[i]["content"], add_special_tokens=False)["input_ids"])
            turn.append(tokenizer.eos_token_id)
            ids += turn
            labels += turn
            following = i + 1
            while following < len(messages) and messages[following]["role"] != "assistant":
                following += 1
            if following < len(messages):  # another assistant turn follows: the replies in between, not learned
                delta = template_delta(tokenizer, messages[i + 1:following], stop_text=stop, tools=tools)
                ids += delta
                labels += [-100] * len(delta)
            i = following
        seqs.append(ids)
        targets.append(labels)
    return _right_padded(tokenizer, seqs, targets)


def warm_start_chats(init_dir: str | Path, train_path: str | Path, val_path: str | Path, out_dir: str | Path, *,
                     steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE,
                     seed: int = 0, max_val: int = 256, chat_template: str | None = None,
                     progress: Callable[[int, float], None] | None = None) -> dict:
    """A warm start on whole conversations (JSONL rows `{"messages": [...], "tools": [...]}`, `encode_chat_batch`):
    the format an
    agent task's episodes take, learned before RL. Trained like `warm_start` (float32, `WARM_START_THREADS`
    threads, deterministic for a seed); returns `steps`, `final_loss`, the held-out loss on the assistant turns
    before and after (`val_loss_before`, `val_loss`, the first `max_val` conversations), `n_train`, `n_val`,
    `time_s`, `out_dir`. `chat_template`: a Jinja chat template that replaces the tokenizer's (and is saved with the
    model), e.g. one that renders tools and tool calls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 0:
        raise ValueError(f"steps={steps} must be >= 0")
    threads = torch.get_num_threads()
    torch.set_num_threads(WARM_START_THREADS)
    try:
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(init_dir)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
        train, val = _conversations(train_path), _conversations(val_path)[:max_val]

        def held_out() -> float:
            with torch.no_grad():
                ids, mask, labels = encode_chat_batch(tokenizer, val)
                return float(model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss)

        before = held_out()
        losses = _fit(model, lambda rows: encode_chat_batch(tokenizer, [train[i] for i in rows]), len(train),
                      steps=steps, lr=lr, batch_size=batch_size, seed=seed, progress=progress)
        after = held_out()
        out = _save(model, tokenizer, out_dir)
    finally:
        torch.set_num_threads(threads)
    tail = losses[-10:]
    return {"steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed,
            "final_loss": sum(tail) / len(tail) if tail else float("nan"), "val_loss_before": before,
            "val_loss": after, "n_train": len(train), "n_val": len(val), "time_s": time.perf_counter() - started,
            "out_dir": str(out)}


def _conversations(path: str | Path) -> list[dict]:
    """The rows of a JSONL file of conversations; ValueError naming the file and line of a row without `messages`,
    whose messages are not `{"role": text, "content": text}`, or whose `tools` is not a list of schemas."""
    from rl_core.data.jsonl import iter_jsonl

    out = []
    for lineno, record in iter_jsonl(Path(path), 'a conversation {"messages": [...]}'):
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages) or not isinstance(record.get("tools", []), list):
            raise ValueError(f'{path}:{lineno}: a conversation row is {{"messages": [{{"role": text, "content": '
                             'text}, ...], "tools": [JSON schema, ...] (optional)}')
        out.append(record)
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out
