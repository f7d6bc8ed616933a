"""A sequence classifier's score of each row: the score head's output at the row's last real token.

The head (`score` in transformers' causal-LM families' `...ForSequenceClassification`) is read from inside the model's
whole forward, so a sharded model gathers its parameters as it does in training and LoRA's trained copy of the head
is the one read; the model's own pooling, which finds a row's last token by the pad id (a real token in some
tokenizers, e.g. a base model's EOS), is not used: the attention mask decides.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rl_core.primitives.logprobs import position_ids_from_mask

HEAD = "score"  # the score head's attribute in transformers' causal-LM families (`...ForSequenceClassification`)


def head_module(model: torch.nn.Module) -> torch.nn.Module:
    """The score head that the forward calls: the model's `score`, or under LoRA PEFT's wrapper of the trained copy."""
    for name, module in model.named_modules():
        if (name == HEAD or name.endswith("." + HEAD)) and "modules_to_save" not in name \
                and "original_module" not in name:
            return module
    raise ValueError(f"{type(model).__name__} has no `{HEAD}` head: a reward model is an "
                     "AutoModelForSequenceClassification of a causal-LM family")


@contextmanager
def _captured(module: torch.nn.Module):
    out: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, o: out.append(o))
    try:
        yield out
    finally:
        handle.remove()


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B]` float32: each row's score, the head's output at its last real token (left padding allowed, positions
    counted from its first real token).

    The model runs its whole forward (so a sharded model gathers its parameters as it does in training) and the head's
    per-token output is read from it; the model's own pooling, which finds the last token by the pad id, is not used."""
    with _captured(head_module(model)) as out:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    per_token = out[-1][..., 0].float()  # [B, T]
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * positions).argmax(-1)
    return per_token[torch.arange(per_token.shape[0], device=per_token.device), last]


__all__ = ["HEAD", "head_module", "sequence_scores"]
