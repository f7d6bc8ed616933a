"""Preference pairs for DPO: loading, the pandera gate, the arithmetic pair builder and the batch layout.

A pair is `{"prompt": str, "chosen": str, "rejected": str}` (optional `"pair_id": int`, unique and
≥ 0; the line index when absent; other keys, e.g. `"source"`, are kept and ignored). Sources: a
JSONL file, or a Hugging Face dataset id `org/name[:split]` with the same columns (needs the
optional `datasets` package).

The gate (`validate_preference_pairs`, schema `PreferencePairs` in `rl_core.batch.gate`): non-empty (after stripping)
prompt/chosen/rejected, `chosen != rejected`, unique pair ids, and — with a tokenizer — token
lengths within the limits given as parameters (`prompt_tokens <= max_prompt_tokens`,
`chosen_tokens`/`rejected_tokens <= max_response_tokens`, responses counted with their EOS). A
refusal raises `rl_core.batch.gate.PreferencePairsError` naming every failing check and a few rows.

Batch layout (`pairs_to_trajectory`). The trainer takes a `Trajectory`, so a DPO batch is one, with
two rows per pair: pair k of the batch is rows `2k` (chosen) and `2k + 1` (rejected). Each row is the
prompt, left-padded to the longest prompt, then the response tokens and EOS, padded on the right
(the rollout layout); `loss_mask` is 1 on the response tokens and EOS. `rewards` is 1.0 on chosen
rows and 0.0 on rejected rows (a label, not a reward), `group_ids` is the pair id on both rows,
`sample_ids` is `2 · pair_id + (0 | 1)`, `rollout_logp` is 0 (no rollout) and `ref_logp` carries the
reference model's per-token log-probs once computed (`rl_core.algorithms.dpo.with_reference_logps`).
Consecutive splits of an even number of rows keep pairs whole (`check_pair_layout` refuses others);
`pair_rows(k)` gives the rows of a selection of pairs. `validate_pair_batch` refuses a batch before dispatch that
is not whole pairs, lacks finite reference log-probs or does not split into whole pairs per worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rl_core.atomic import write_text_atomic
from rl_core.data.jsonl import iter_jsonl, raise_row_errors

if TYPE_CHECKING:
    import pandas as pd

# pandas and the pandera gate load where a pair table is built: the DPO objective imports this module for the
# batch layout, and with it every process that reads a config (Ray actors included), which need neither.

PAIR_FIELDS = ("prompt", "chosen", "rejected")
CHOSEN_LABEL = 1.0  # rewards on chosen rows
REJECTED_LABEL = 0.0  # rewards on rejected rows


def _as_frame(pairs: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    import pandas as pd

    df = pairs.copy() if isinstance(pairs, pd.DataFrame) else pd.DataFrame(list(pairs))
    missing = [c for c in PAIR_FIELDS if c not in df.columns]
    if missing:
        raise ValueError(f"preference pairs need columns {list(PAIR_FIELDS)}; missing {missing}")
    if "pair_id" not in df.columns:
        df.insert(0, "pair_id", np.arange(len(df), dtype=np.int64))
    for col in PAIR_FIELDS:  # None/NaN become "" so that non_empty names them
        df[col] = df[col].map(lambda v: "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v))
    df["pair_id"] = df["pair_id"].astype(np.int64)
    return df.reset_index(drop=True)


def pair_token_lengths(df: pd.DataFrame, tokenizer, *, task: str = "arithmetic",
                       template: str = "plain", data=None) -> pd.DataFrame:
    """`prompt_tokens`, `chosen_tokens`, `rejected_tokens` as `pairs_to_trajectory` lays them out (responses + EOS)."""
    import pandas as pd

    prompts = _encode_prompts(tokenizer, list(df["prompt"]), task, template, data)
    return pd.DataFrame({
        "prompt_tokens": np.array([len(p) for p in prompts], dtype=np.int64),
        "chosen_tokens": np.array([len(r) for r in _encode_responses(tokenizer, df["chosen"])], dtype=np.int64),
        "rejected_tokens": np.array([len(r) for r in _encode_responses(tokenizer, df["rejected"])], dtype=np.int64),
    }, index=df.index)


def validate_preference_pairs(pairs: pd.DataFrame | Iterable[dict], *, tokenizer=None,
                              max_prompt_tokens: int | None = None, max_response_tokens: int | None = None,
                              task: str = "arithmetic", template: str = "plain", data=None) -> pd.DataFrame:
    """The pair gate: returns the validated frame (with `pair_id`, and token-length columns when a tokenizer is given).

    Raises `PreferencePairsError` naming each failing check (`non_empty`, `chosen!=rejected`,
    `field_uniqueness` on pair_id, `chosen_tokens<=max_response_tokens(N)`, ...). Token limits need a
    tokenizer (ValueError otherwise).
    """
    from rl_core.batch.gate import validate_pair_table

    df = _as_frame(pairs)
    if (max_prompt_tokens is not None or max_response_tokens is not None) and tokenizer is None:
        raise ValueError("token-length limits need the tokenizer that will encode the pairs")
    if tokenizer is not None:
        lengths = pair_token_lengths(df, tokenizer, task=task, template=template, data=data)
        for col in lengths:
            df[col] = lengths[col]
    return validate_pair_table(df, max_prompt_tokens=max_prompt_tokens, max_response_tokens=max_response_tokens)


# ------------------------------------------------------------------------------------------ loading


def load_preference_pairs(source: str | Path) -> pd.DataFrame:
    """Pairs of a JSONL file, or of a hub dataset `org/name[:split]` (default split `train`); not yet validated."""
    path = Path(source)
    if path.is_file() or path.is_dir():  # a directory: refused by iter_jsonl, naming it
        records = []
        errors: list[str] = []  # every bad line, raised together
        for lineno, rec in iter_jsonl(path, "a preference pair {prompt, chosen, rejected}", errors):
            if any(k not in rec for k in PAIR_FIELDS):
                errors.append(f"{path}:{lineno}: a preference pair needs {list(PAIR_FIELDS)}, got {sorted(rec)}")
                continue
            records.append(rec)
        raise_row_errors(errors)
        if not records:
            raise ValueError(f"{path}: no preference pairs")
        return _as_frame(records)
    if path.suffix in (".jsonl", ".json") or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"preference pairs {str(source)!r} do not exist (build the arithmetic pairs with "
                                "rl_core.data.preferences.make_arithmetic_pairs)")
    try:
        import datasets  # optional: only for hub sources
    except ImportError as exc:
        raise ImportError(f"preference pairs {str(source)!r} look like a hub dataset id, which needs the optional "
                          "'datasets' package (pip install datasets); or pass a JSONL file") from exc
    name, _, split = str(source).partition(":")
    ds = datasets.load_dataset(name, split=split or "train")
    return _as_frame({k: row[k] for k in PAIR_FIELDS} for row in ds)


def write_pairs_jsonl(df: pd.DataFrame, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = ["pair_id", *PAIR_FIELDS] + [c for c in df.columns if c not in ("pair_id", *PAIR_FIELDS)
                                        and not c.endswith("_tokens")]
    lines = []
    for rec in df[cols].to_dict("records"):
        rec["pair_id"] = int(rec["pair_id"])
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    return write_text_atomic(path, "".join(lines))


# ------------------------------------------------------------------------------ arithmetic builder


def _encode_prompts(tokenizer, prompts: Sequence[str], task: str, template: str, data=None) -> list[list[int]]:
    from rl_core.tasks import Example, encode_prompts

    return encode_prompts(tokenizer, [Example(str(p), "") for p in prompts], task, template, data)


def _encode_responses(tokenizer, responses: Iterable[str]) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; DPO responses end with EOS as sampled completions do")
    return [list(tokenizer(str(r), add_special_tokens=False)["input_ids"]) + [int(eos)] for r in responses]


def pairs_to_trajectory(pairs: pd.DataFrame | Iterable[dict], tokenizer, *, task: str = "arithmetic",
                        template: str = "plain", data=None):
    """Tensorise pairs into the DPO batch layout (module docstring): a `Trajectory` of `2P` rows.

    Prompts are encoded exactly as the rollout encodes them (`encode_prompts` with `task`, `template` and
    the `data` config section's system prompt and instruction), responses as `tokenizer(text, add_special_tokens=False) + [EOS]`.
    """
    from rl_core.batch.trajectory import Trajectory

    df = _as_frame(pairs)
    if len(df) == 0:
        raise ValueError("pairs_to_trajectory: no pairs")
    prompts = _encode_prompts(tokenizer, list(df["prompt"]), task, template, data)
    chosen = _encode_responses(tokenizer, df["chosen"])
    rejected = _encode_responses(tokenizer, df["rejected"])
    rows_prompt = [p for p in prompts for _ in range(2)]
    rows_resp = [r for pair in zip(chosen, rejected) for r in pair]
    P = max(len(p) for p in rows_prompt)
    R = max(len(r) for r in rows_resp)
    n = len(rows_prompt)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((n, P + R), int(pad), dtype=torch.long)
    attention = torch.zeros((n, P + R), dtype=torch.long)
    loss_mask = torch.zeros((n, P + R), dtype=torch.float32)
    for j, (p, r) in enumerate(zip(rows_prompt, rows_resp)):
        input_ids[j, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[j, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[j, P - len(p):P + len(r)] = 1
        loss_mask[j, P:P + len(r)] = 1.0
    pair_ids = torch.tensor([int(k) for k in df["pair_id"]], dtype=torch.long).repeat_interleave(2)
    side = torch.arange(n) % 2
    return Trajectory(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logp=torch.zeros((n, P + R), dtype=torch.float32),
        rewards=torch.where(side == 0, CHOSEN_LABEL, REJECTED_LABEL).float(),
        group_ids=pair_ids,
        sample_ids=2 * pair_ids + side,
        policy_version=0,
    )


def pair_rows(pair_positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Row indices `[2k, 2k + 1, ...]` of the pairs at positions `k` of a pair batch (for `Trajectory.select`)."""
    k = torch.as_tensor(pair_positions, dtype=torch.long).reshape(-1)
    return torch.stack([2 * k, 2 * k + 1], dim=1).reshape(-1)


def check_pair_layout(batch: Any) -> None:
    """Refuse a batch that is not whole pairs in the layout (rows 2k chosen, 2k + 1 rejected, same pair id)."""
    n = batch.batch_size
    if n % 2:
        raise ValueError(f"a DPO batch holds (chosen, rejected) row pairs, got {n} rows: micro- and mini-batch sizes "
                         "must be even numbers of rows so that splits keep pairs whole")
    ids = batch.group_ids
    if not bool((ids[0::2] == ids[1::2]).all()):
        raise ValueError("DPO rows 2k and 2k+1 must belong to the same pair (group_ids): the batch was split or "
                         "reordered across pairs; select pairs with rl_core.data.preferences.pair_rows")
    if not (bool((batch.rewards[0::2] == CHOSEN_LABEL).all()) and bool((batch.rewards[1::2] == REJECTED_LABEL).all())):
        raise ValueError("DPO rows 2k must be chosen (rewards 1.0) and rows 2k+1 rejected (rewards 0.0); build the "
                         "batch with rl_core.data.preferences.pairs_to_trajectory")
    if bool((batch.loss_mask.sum(-1) <= 0).any()):
        raise ValueError("a DPO row has no response token in loss_mask")


def validate_pair_batch(batch: Any, num_workers: int, reference: bool = True) -> Any:
    """Refuse a pair batch that is not whole (chosen, rejected) pairs, does not split into whole pairs per worker,
    or (`reference`: DPO) lacks finite reference log-probs."""
    check_pair_layout(batch)
    pairs = batch.batch_size // 2
    if pairs % num_workers:
        raise ValueError(f"{pairs} pairs do not split into whole pairs across cluster.num_workers={num_workers}")
    if not reference:
        return batch
    ref = batch.ref_logp
    if ref is None:
        raise ValueError("batch.ref_logp is missing: score the reference once with with_reference_logps")
    on = batch.loss_mask > 0
    bad = on & ~(torch.isfinite(ref) & (ref <= 1e-6))
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(-1)).flatten().tolist()
        raise ValueError(f"batch refused before dispatch: ref_logp is not a finite log-prob on rows {rows[:8]}")
    return batch
