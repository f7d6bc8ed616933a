"""A reward model as a reward: a sequence-classification model scores each (prompt, completion) in batches
(docs/rewards.md).

`data.rewards` names one with `{model: <hub id | directory | finished run directory>, weight, name, normalize,
batch_size}`. `ModelScorer` holds the model (frozen, in eval mode) and its tokenizer and scores a batch of reward
inputs (`rl_core.rewards.RewardInputs`) `batch_size` rows at a time; `infra.workers.reward_model` places its
replicas in the cluster.

Rendering, as the reward model's training pairs are laid out (`rl_core.data.preferences.pairs_to_trajectory`):
the prompt as the policy sees it (the run's `data.task`, `data.prompt_template`, system prompt and instruction,
with the reward model's tokenizer), then the completion's tokens and EOS. A multi-turn conversation (an agent's
episode) is the reward model's chat template over the whole conversation. Rows are left-padded; a row's score is
the head's output at its last real token (`rl_core.primitives.scores.sequence_scores`), so scoring a batch
gives each row what scoring it alone gives.

`normalize`: `none` (the raw score), `sigmoid` (σ(score), in (0, 1): the probability the model's Bradley–Terry
reading gives the completion of beating one scored 0) or `batch` (standardised over the step's batch: (s − mean)
/ std, std over the batch, 0 when every score is equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

NORMALIZATIONS = ("none", "sigmoid", "batch")
FINAL_MODEL = "final_model"  # a finished run's model directory (infra.checkpoints.store.FINAL_MODEL)


def resolve_reward_model(name_or_path: str, key: str) -> str:
    """A hub id unchanged; a local directory as an absolute path: the model itself, or a finished run's directory
    (its `final_model/`). ValueError naming `key` when a local path holds no model."""
    from rl_core.model.loading import looks_local

    if not looks_local(name_or_path):
        return name_or_path
    path = Path(name_or_path).expanduser()
    if (path / FINAL_MODEL / "config.json").is_file():
        path = path / FINAL_MODEL
    if not (path / "config.json").is_file():
        raise ValueError(f"{key}={name_or_path!r}: no model there (no config.json, nor a finished run's "
                         f"{FINAL_MODEL}/); train one first (posttrain run recipes/rm_arithmetic.py) or name a hub id")
    return str(path.resolve())


def render(tokenizer: Any, prompt: Any, completion: Any, data: Any) -> list[int]:
    """The token ids the reward model reads for one completion (module docstring)."""
    from rl_core.tasks import Example, encode_prompts

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the reward model's tokenizer has no eos_token_id: a scored completion ends with EOS")
    if isinstance(completion, list) and not (len(completion) == 1 and completion[0].get("role") == "assistant"
                                             and "tool_calls" not in completion[0]):
        messages = [dict(m) for m in (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])]
        return list(tokenizer.apply_chat_template(messages + [dict(m) for m in completion], tokenize=True,
                                                  return_dict=False))
    if isinstance(prompt, list):
        users = [m for m in prompt if m.get("role") == "user"]
        example = Example(str(users[-1]["content"]) if users else "", "", messages=tuple(dict(m) for m in prompt))
    else:
        example = Example(str(prompt), "")
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    ids = encode_prompts(tokenizer, [example], data.task, data.prompt_template, data)[0]
    return list(ids) + list(tokenizer(str(text), add_special_tokens=False)["input_ids"]) + [int(eos)]


def left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` `[B, T]` of `rows`, left-padded with `pad`."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def normalized(scores: Sequence[float], how: str) -> list[float]:
    """`scores` under `normalize` (module docstring)."""
    if how == "none":
        return [float(s) for s in scores]
    if how == "sigmoid":
        return torch.sigmoid(torch.tensor([float(s) for s in scores], dtype=torch.float64)).tolist()
    if how == "batch":
        t = torch.tensor([float(s) for s in scores], dtype=torch.float64)
        std = float(t.std(unbiased=False)) if len(t) > 1 else 0.0
        return [0.0] * len(t) if std == 0.0 else ((t - t.mean()) / std).tolist()
    raise ValueError(f"normalize={how!r}: one of {', '.join(NORMALIZATIONS)}")


class ModelScorer:
    """A frozen reward model and its tokenizer on `device`, scoring completions `batch_size` at a time."""

    def __init__(self, name_or_path: str, *, data: Any, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rl_core.primitives.scores import head_module

        self.data, self.batch_size, self.device = data, int(batch_size), torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, dtype=dtype, trust_remote_code=trust_remote_code).to(self.device).eval().requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(f"{name_or_path}: a reward model has one output (num_labels=1), this one "
                             f"{self.model.config.num_labels}: it is a classifier, not a reward model")
        head_module(self.model)  # a head the scores can be read from (ValueError else)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id

    def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[float]:
        """One raw score per completion (float), in order."""
        from rl_core.primitives.scores import sequence_scores

        rows = [render(self.tokenizer, p, c, self.data) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(rows), self.batch_size):
                ids, mask = left_padded(rows[start:start + self.batch_size], self.pad)
                out.extend(sequence_scores(self.model, ids.to(self.device), mask.to(self.device)).tolist())
        return out


class ModelReward:
    """A reward model's `data.rewards` entry as a TRL-style reward function, for scoring in one process (a held-out
    evaluation outside a cluster): the model is loaded on CPU at the first call. In a run, the cluster's reward-model
    role scores the entry instead (`infra.workers.reward_model`) and this is never called."""

    def __init__(self, entry: Any, data: Any, key: str):
        self.entry, self.data, self.key = entry, data, key
        self.__name__ = entry.name or "reward_model"
        self.scorer: ModelScorer | None = None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
        if self.scorer is None:
            self.scorer = ModelScorer(resolve_reward_model(self.entry.model, self.key), data=self.data,
                                      batch_size=self.entry.batch_size)
        return normalized(self.scorer.score(prompts, completions), self.entry.normalize)


__all__ = ["NORMALIZATIONS", "ModelReward", "ModelScorer", "left_padded", "normalized", "render", "resolve_reward_model"]
