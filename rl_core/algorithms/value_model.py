"""The critic's model for PPO: the policy's architecture with a value head, `AutoModelForTokenClassification` with one
label (the backbone loaded from the policy's weights, the head `score` new), so it saves and loads as a Hugging Face
model of its own.

Alignment: the value of the state before token t is read where the policy reads token t's log-prob, at the hidden
state of position t − 1 (`token_values`), so `values[i, t]` pairs with `logp[i, t]` and the GAE of
`rl_core.primitives.gae` on the same mask.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_core.primitives.logprobs import position_ids_from_mask


def value_model(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                head_std: float = 0.0, sequence: bool = False):
    """The critic built from the policy at `name_or_path` (a hub id or a local directory): its backbone's weights, and a
    value head of one output initialised N(0, head_std²) (0: every value starts at 0), its bias (where the
    architecture's head has one) 0, and no dropout before it. A head the checkpoint already has is kept.

    `sequence`: an `AutoModelForSequenceClassification` (a reward model, `rl_core.algorithms.reward_model`) rather than
    a token classifier."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
    from transformers.utils import logging

    config = AutoConfig.from_pretrained(str(name_or_path), num_labels=1, trust_remote_code=trust_remote_code)
    config.classifier_dropout = 0.0  # a value is a regression target: no dropout before the head (transformers' 0.1)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report names the new head and the unused LM head: checked below instead
    try:
        auto = AutoModelForSequenceClassification if sequence else AutoModelForTokenClassification
        model, info = auto.from_pretrained(
            str(name_or_path), config=config, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True)
    finally:
        logging.set_verbosity(verbosity)
    head_name = value_head_name(model)
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(f"{head_name}."))
    if missing:
        raise ValueError(f"the {'reward model' if sequence else 'critic'}'s backbone from {name_or_path} lacks {len(missing)} weight(s) ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''}): it is not a model of the policy's architecture")
    head = getattr(model, head_name)
    if not any(k.startswith(f"{head_name}.") for k in info.get("missing_keys", ())):
        return model  # a model with its head already trained (a reward model, a critic's export)
    with torch.no_grad():
        if head_std > 0:
            head.weight.normal_(0.0, head_std)
        else:
            head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    return model


def value_head_name(model: torch.nn.Module) -> str:
    """The value head's attribute: `score` in transformers' causal-LM families, `classifier` in the others."""
    return "score" if hasattr(model, "score") else "classifier"


def token_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` float32: the critic's value of the state before each token (the hidden state of the position before
    it, module docstring); 0 at a row's first position and wherever `attention_mask` is 0. Left-padded rows get
    positions counted from their first real token."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    scores = out.logits[..., 0].float()
    values = torch.zeros_like(scores)
    values[:, 1:] = scores[:, :-1]
    real = attention_mask.bool()
    previous_real = torch.zeros_like(real)
    previous_real[:, 1:] = real[:, :-1]
    return values * (real & previous_real)
