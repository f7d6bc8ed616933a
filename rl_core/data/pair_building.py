"""Building preference pairs for the DPO quickstart: a model's own wrong answers against the right ones.

`make_arithmetic_pairs` samples the warm-started tiny model on the arithmetic train split and pairs each
right answer (chosen) with a wrong one (rejected): the model's own, or an answer one digit off. The pairs'
format and checks are rl_core/data/preferences.py's. `make_judge_rows` turns pairs into a pointwise judge's
supervised rows: each answer's judge request and its verdict.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from rl_core.atomic import write_text_atomic
from rl_core.data.preferences import load_preference_pairs, validate_preference_pairs, write_pairs_jsonl


def off_by_one_digit(answer: str, rng: np.random.Generator) -> str:
    """A wrong integer answer: one digit (chosen by `rng`) moved by ±1, never a new leading zero.

    `"46"` -> e.g. `"47"`, `"36"`; `"-7"` -> `"-6"` or `"-8"`; `"0"` -> `"1"`. Always `!= answer`.
    """
    text = str(answer).strip()
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    if not digits.isdigit():
        raise ValueError(f"off_by_one_digit needs an integer answer, got {answer!r}")
    pos = int(rng.integers(len(digits)))
    d = int(digits[pos])
    options = [x for x in (d - 1, d + 1) if 0 <= x <= 9 and not (pos == 0 and x == 0 and len(digits) > 1)]
    new = options[int(rng.integers(len(options)))]
    return sign + digits[:pos] + str(new) + digits[pos + 1:]


def _model_answers(model_dir: str | Path, prompts: list[str], max_tokens: int, samples: int = 0,
                   seed: int = 0) -> list[str]:
    """Greedy answers of the model in `model_dir` (float32, CPU), stripped, as the reward sees them ("" for one the
    length limit cut); with `samples` > 0, that many answers per prompt sampled at temperature 1 (seeded), prompt
    by prompt, cut ones included."""
    from rl_core.config import ModelConfig
    from rl_core.model.loading import load_policy
    from rl_core.rollout.base import SamplingParams
    from rl_core.rollout.hf import HFEngine
    from rl_core.tasks import Example, encode_prompts

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(model_dir)))
    engine = HFEngine(model, tokenizer)
    n = max(samples, 1)
    out: list[str] = []
    for start in range(0, len(prompts), 256):
        sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, greedy=not samples, seed=seed + start)
        chunk = [Example(p, "") for p in prompts[start:start + 256]]
        completions = engine.generate(encode_prompts(tokenizer, chunk, "arithmetic", "plain"), n, sampling)
        texts = completions.decode_responses(tokenizer)
        # a greedy answer the length limit cut has no EOS: as a DPO response it would not fit the limit (the pair
        # gate); sampled ones are kept, a reward model must learn to score what a policy's cut answers look like
        out.extend(t.strip() if r == "stop" or samples else "" for t, r in
                   zip(texts, completions.finish_reason, strict=True))
    return out


def make_arithmetic_pairs(train_jsonl: str | Path, out_path: str | Path, *, seed: int,
                          model_dir: str | Path | None = None, max_pairs: int | None = None,
                          max_tokens: int = 4, samples: int = 0) -> dict:
    """Preference pairs from the arithmetic split: chosen = the correct answer, rejected = a wrong one.

    Rejected: without `model_dir`, `off_by_one_digit(answer)` with a generator seeded by
    `(seed, crc32(prompt))` (deterministic and independent of file order). With `model_dir`, the
    model's own greedy answer (up to `max_tokens` tokens) where it is wrong and non-empty (a hard
    negative the policy actually produces), the off-by-one answer elsewhere. With `model_dir` and `samples` > 0, each
    prompt gives `samples` pairs, one per answer the model samples at temperature 1 (a reward model's training
    data: the wrong answers a policy samples as it trains). `max_pairs` keeps the first prompts of the file. Writes validated JSONL records `{pair_id, prompt, chosen, rejected,
    source}` (`source`: "off_by_one" | "model") and returns `{"path", "n_pairs", "n_model_negatives"}`.
    """
    from rl_core.rewards.arithmetic import arithmetic_reward
    from rl_core.tasks import load_examples

    examples = load_examples(train_jsonl, "arithmetic")
    if max_pairs is not None:
        examples = examples[:max_pairs]
    if not examples:
        raise ValueError(f"{train_jsonl}: no examples")
    per = max(samples, 1) if model_dir else 1
    model_answers = _model_answers(model_dir, [e.prompt for e in examples], max_tokens, samples, seed) \
        if model_dir else None
    records = []
    for k, ex in enumerate(examples):
        rng = np.random.default_rng([int(seed), zlib.crc32(ex.prompt.encode("utf-8"))])
        for j in range(per):
            rejected, source = off_by_one_digit(ex.answer, rng), "off_by_one"
            if model_answers is not None:
                guess = model_answers[k * per + j]
                if guess and arithmetic_reward(guess, ex.answer) == 0.0:
                    rejected, source = guess, "model"
            records.append({"pair_id": k * per + j, "prompt": ex.prompt, "chosen": ex.answer, "rejected": rejected,
                            "source": source})
    df = validate_preference_pairs(records)
    path = write_pairs_jsonl(df, out_path)
    return {"path": str(path), "n_pairs": len(df), "n_model_negatives": int((df["source"] == "model").sum())}


def make_judge_rows(pairs_jsonl: str | Path, out_path: str | Path, *, template: str) -> dict:
    """A pointwise judge's supervised rows from preference pairs whose chosen answer is the reference: per pair, the
    judge request (`rl_core.rewards.judge.pointwise_request` of `template`, exactly what the judge is sent in a run)
    of the chosen answer with verdict "1" and of the rejected one with verdict "0", as `{"prompt", "answer"}` JSONL
    rows (what `posttrain warm-start` trains on: it learns the verdict after the request). Balanced by construction.
    Returns `{"path", "n_rows"}`."""
    import json

    from rl_core.rewards.judge import pointwise_request

    pairs = validate_preference_pairs(load_preference_pairs(pairs_jsonl))
    lines = [json.dumps({"prompt": pointwise_request(template, row["prompt"], answer, row["chosen"]),
                         "answer": verdict}, ensure_ascii=False) + "\n"
             for row in pairs.to_dict("records") for answer, verdict in ((row["chosen"], "1"), (row["rejected"], "0"))]
    path = write_text_atomic(Path(out_path), "".join(lines))
    return {"path": str(path), "n_rows": len(lines)}

