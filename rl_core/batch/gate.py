"""The gate: every pandera schema a batch must satisfy before it may reach a trainer, in one module.

- `AnnotationsTable`, one row per completion built by the annotate phase: `validate_annotations` adds the
  run's bounds (`rollout.max_response_tokens`: max_tokens x max_turns, whether advantages are group-relative); `validate_batch_tensors`
  checks the tensor batch (shapes, dtypes, masks, log-probs) row by row against the table, and that the loss
  mask marks only tokens the policy sampled (an agent episode's tool results and user turns are not).
- `TeacherRows` (OPD): `validate_teacher_logp`, the teacher's scores on the loss tokens.
- `PreferencePairs` (DPO): `validate_pair_table`, the pairs before they become a batch (a pair batch's layout
  and reference log-probs: `rl_core.data.preferences.validate_pair_batch`).

Every refusal raises `BatchValidationError` (a ValueError) naming each failing check and a few rows;
`failures_frame` turns pandera's failure cases into the table it reports.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa
import torch
from pandera.typing import Series


class BatchValidationError(ValueError):
    """A batch failed the gate; `.failures` is a DataFrame of (check, column, index, value)."""

    def __init__(self, what: str, failures: pd.DataFrame, rows: pd.DataFrame | None = None, max_rows: int = 5):
        self.failures = failures
        lines = [f"{what}: batch refused before dispatch ({failures['check'].nunique()} failing check(s))"]
        for check, group in failures.groupby("check", sort=False):
            cols = sorted({str(c) for c in group["column"].dropna()})
            where = ", ".join(cols) if 0 < len(cols) <= 2 else "whole rows"
            idx = [int(i) for i in group["index"].dropna().unique() if _is_int(i)]
            count = len(idx) or len(group)
            shown = "" if len(cols) > 2 else ", e.g. " + ", ".join(str(v) for v in group["failure_case"].head(max_rows))
            hint = _HINTS.get(str(cols[0]) if len(cols) == 1 else "", "")
            lines.append(f"  - {check} on {where}: {count} failing{shown}{hint}"
                         + (f" (rows {idx[:max_rows]})" if idx else ""))
            if rows is not None and idx:
                sample = rows.loc[[i for i in idx[:3] if i in rows.index]]
                lines.extend("      " + line for line in sample.to_string().splitlines())
        super().__init__("\n".join(lines))


_HINTS = {"response_len": " [bound: rollout.max_tokens x rollout.max_turns]",
          "loss_on_unsampled": " [the loss mask marks tokens the policy did not sample: an environment's or a tool's]"}


def _is_int(value: Any) -> bool:
    try:
        return float(value).is_integer()
    except (TypeError, ValueError):
        return False


class AnnotationsTable(pa.DataFrameModel):
    """One row per completion of a step, after reward and annotation."""

    sample_id: Series[int] = pa.Field(ge=0, unique=True)
    # the episode row a row trains for: its own sample_id, an earlier sample's episode row, -1 a row that only fills
    # the batch's shape (rl_core.annotate)
    sample_of: Series[int] = pa.Field(ge=-1)
    prompt_id: Series[int] = pa.Field(ge=0)
    group_id: Series[int] = pa.Field(ge=0)
    group_size: Series[int] = pa.Field(ge=1)
    reward: Series[float] = pa.Field()
    advantage: Series[float] = pa.Field()
    response_len: Series[int] = pa.Field(ge=0)
    truncated: Series[bool] = pa.Field()
    started: Series[bool] = pa.Field()  # False: an agent episode that could not start (no response, no loss)
    masked_len: Series[int] = pa.Field(ge=0)  # response tokens annotate left out of the loss on purpose
    policy_version: Series[int] = pa.Field(ge=0)

    class Config:
        strict = True  # no missing, no extra columns
        coerce = False
        ordered = False

    @pa.check("reward", name="finite_reward")
    def _finite_reward(cls, s: Series[float]) -> Series[bool]:
        return pd.Series(np.isfinite(s.to_numpy(dtype=float)), index=s.index)

    @pa.check("advantage", name="finite_advantage")
    def _finite_advantage(cls, s: Series[float]) -> Series[bool]:
        return pd.Series(np.isfinite(s.to_numpy(dtype=float)), index=s.index)

    @pa.dataframe_check(name="complete_groups")
    def _complete_groups(cls, df: pd.DataFrame) -> Series[bool]:
        counts = df[_episode_rows(df)].groupby("group_id")["sample_id"].count()
        return df["group_id"].map(counts).fillna(0).astype(int) == df["group_size"]

    @pa.dataframe_check(name="a_sample_shares_its_episode's_group_and_reward")
    def _samples_share(cls, df: pd.DataFrame) -> Series[bool]:
        return _shares(df, ("group_id", "reward"))

    @pa.dataframe_check(name="a_filler_row_has_no_loss_and_no_advantage")
    def _filler(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["sample_of"] >= 0) | ((df["masked_len"] == df["response_len"]) & (df["advantage"] == 0))

    @pa.dataframe_check(name="response_len>=1 (unless the episode did not start)")
    def _a_response(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["response_len"] >= 1) | ~df["started"]

    @pa.dataframe_check(name="masked_len<=response_len")
    def _masked_within_response(cls, df: pd.DataFrame) -> Series[bool]:
        return df["masked_len"] <= df["response_len"]

    @pa.dataframe_check(name="one_prompt_per_group")
    def _one_prompt_per_group(cls, df: pd.DataFrame) -> Series[bool]:
        return df.groupby("group_id")["prompt_id"].transform("nunique") == 1

    @pa.dataframe_check(name="one_policy_version")
    def _one_policy_version(cls, df: pd.DataFrame) -> Series[bool]:
        mode = df["policy_version"].mode()
        return df["policy_version"] == (mode.iloc[0] if len(mode) else -1)


def _shares(df: pd.DataFrame, columns: tuple[str, ...]) -> pd.Series:
    """Every row of an episode holds its episode row's values of `columns` (a filler row has no episode)."""
    episode = df[_episode_rows(df)].set_index("sample_id")
    agrees = pd.Series(True, index=df.index)
    for column in columns:
        agrees &= df["sample_of"].map(episode[column]) == df[column]
    return (df["sample_of"] < 0) | agrees


def _episode_rows(df: pd.DataFrame) -> pd.Series:
    """The rows a group's statistics count: one per completion or episode (`sample_of` is the row's own id)."""
    return df["sample_of"] == df["sample_id"]


def annotations_schema(max_tokens: int, group_relative: bool = True, atol: float = 1e-4,
                       versions: tuple[int, int] | None = None) -> pa.DataFrameSchema:
    """`AnnotationsTable` plus the run's bounds: lengths within `max_tokens`; group advantages sum to ~0 and an
    episode's samples share its advantage; with
    `versions=(oldest, newest)`, the policy version that sampled the batch within them (the staleness bound)."""
    schema = _bounded_schema(max_tokens, group_relative, atol)
    if versions is None:
        return schema
    oldest, newest = versions
    # the window moves every step: shallow copies of the cached schema and its column (pandera's update_column
    # deep-copies the whole schema, ~0.6 ms a step), the cached objects left as they are
    version = copy.copy(schema.columns["policy_version"])
    version.checks = [*version.checks, pa.Check(
        lambda s: s.between(oldest, newest), element_wise=False,
        name=f"policy_version in [{oldest}, {newest}] (trainer at {newest}, rl.async_steps={newest - oldest})")]
    windowed = copy.copy(schema)
    windowed.columns = {**schema.columns, "policy_version": version}
    return windowed


@functools.lru_cache(maxsize=16)  # built once per run's bounds, not every step (update_column copies)
def _bounded_schema(max_tokens: int, group_relative: bool, atol: float) -> pa.DataFrameSchema:
    schema = AnnotationsTable.to_schema()
    length = schema.columns["response_len"]
    schema = schema.update_column(
        "response_len", checks=[*length.checks, pa.Check.le(max_tokens, name=f"response_len<=rollout.max_response_tokens({max_tokens})")]
    )
    if group_relative:
        def zero_sum(df: pd.DataFrame) -> pd.Series:
            sums = df[_episode_rows(df)].groupby("group_id")["advantage"].sum()
            return df["group_id"].map(sums).fillna(0.0).abs() <= atol * df["group_size"]

        schema = copy.deepcopy(schema)  # group advantages are per episode (PPO's per token differ between samples)
        schema.checks = [*schema.checks, pa.Check(zero_sum, name="group_advantages_sum_to_zero"),
                         pa.Check(lambda df: _shares(df, ("advantage",)),
                                  name="a_sample_shares_its_episode's_advantage")]
    return schema


def failures_frame(exc: pa.errors.SchemaErrors) -> pd.DataFrame:
    """pandera's failure cases as the (check, column, index, failure_case) table a BatchValidationError reports."""
    fc = exc.failure_cases.copy()
    out = pd.DataFrame({
        "check": fc["check"].astype(str).replace({"not_nullable": "not_nullable (NaN or missing)"}),
        "column": fc["column"],
        "index": fc["index"],
        "failure_case": fc["failure_case"],
    })
    return out


def validate_annotations(table: pd.DataFrame, *, max_tokens: int, group_relative: bool = True,
                         versions: tuple[int, int] | None = None) -> pd.DataFrame:
    """Validate the annotations table (all checks, lazily); raise BatchValidationError naming each failure.
    `versions`: the policy versions a batch may come from (`annotations_schema`)."""
    try:
        return annotations_schema(max_tokens, group_relative, versions=versions).validate(table, lazy=True)
    except pa.errors.SchemaErrors as exc:
        raise BatchValidationError("annotations table", failures_frame(exc), table) from None


class BatchRows(pa.DataFrameModel):
    """Per-row summaries of the tensor batch, checked against the annotations table."""

    row: Series[int]
    loss_tokens: Series[int] = pa.Field(ge=0)
    expected_len: Series[int]
    left_out: Series[bool]  # the table says annotate left the whole row out of the loss (mask_truncated)
    loss_outside_attention: Series[int] = pa.Field(eq=0)
    mask_values_binary: Series[bool] = pa.Field(isin=[True])
    logp_finite: Series[bool] = pa.Field(isin=[True])
    logp_max: Series[float] = pa.Field(le=1e-6)
    loss_on_unsampled: Series[int] = pa.Field(eq=0)

    @pa.dataframe_check(name="loss_tokens==response_len-masked_len")
    def _lengths_agree(cls, df: pd.DataFrame) -> Series[bool]:
        return df["loss_tokens"] == df["expected_len"]

    @pa.dataframe_check(name="loss_tokens>=1 (a row leaves the loss whole only by annotate)")
    def _some_loss(cls, df: pd.DataFrame) -> Series[bool]:
        return (df["loss_tokens"] >= 1) | df["left_out"]


TENSOR_FIELDS_2D = ("input_ids", "attention_mask", "loss_mask", "rollout_logp")


def validate_batch_tensors(batch: Any, table: pd.DataFrame | None = None, sampled: torch.Tensor | None = None) -> None:
    """Shapes, dtypes and masks of a Trajectory-like batch; with `table`, rows must agree with it; with `sampled`
    (`[B, T]`, true on the tokens the rollout engine sampled), the loss mask must lie inside it."""
    problems = []
    shapes = {name: tuple(getattr(batch, name).shape) for name in TENSOR_FIELDS_2D}
    ref = shapes["input_ids"]
    if len(ref) != 2:
        problems.append(("shape", "input_ids", None, f"expected [B, T], got {list(ref)}"))
    for name, shape in shapes.items():
        if shape != ref:
            problems.append(("shape", name, None, f"{list(shape)} != input_ids {list(ref)}"))
    if batch.input_ids.dtype != torch.long:
        problems.append(("dtype", "input_ids", None, str(batch.input_ids.dtype)))
    if not torch.is_floating_point(batch.rollout_logp):
        problems.append(("dtype", "rollout_logp", None, str(batch.rollout_logp.dtype)))
    b = ref[0] if ref else 0
    for name in ("rewards", "group_ids", "sample_ids"):
        value = getattr(batch, name, None)
        if value is not None and tuple(value.shape[:1]) != (b,):
            problems.append(("shape", name, None, f"{list(value.shape)} has no leading batch dim {b}"))
    if sampled is not None and tuple(sampled.shape) != ref:
        problems.append(("shape", "sampled", None, f"{list(sampled.shape)} != input_ids {list(ref)}"))
    adv = getattr(batch, "advantages", None)
    if adv is None:
        problems.append(("present", "advantages", None, "missing: annotate before validation"))
    elif not (adv.shape == (b,) or tuple(adv.shape) == ref):
        problems.append(("shape", "advantages", None, f"{list(adv.shape)} is neither [B] nor [B, T]"))
    elif not bool(torch.isfinite(adv).all()):
        problems.append(("finite", "advantages", None, "non-finite advantage"))
    if problems:
        raise BatchValidationError("tensor batch", pd.DataFrame(problems, columns=["check", "column", "index", "failure_case"]))

    attn = batch.attention_mask.float()
    loss = batch.loss_mask.float()
    logp = batch.rollout_logp.float()
    on = loss > 0
    loss_tokens = loss.sum(1).round().long().numpy()
    expected = (table["response_len"] - table["masked_len"]).to_numpy() if table is not None else loss_tokens
    rows = pd.DataFrame({
        "row": np.arange(b),
        "loss_tokens": loss_tokens,
        "expected_len": expected,
        "left_out": (expected == 0) if table is not None else np.zeros(b, dtype=bool),
        "loss_outside_attention": ((loss > 0) & (attn == 0)).sum(1).numpy(),
        "mask_values_binary": (((loss == 0) | (loss == 1)).all(1) & ((attn == 0) | (attn == 1)).all(1)).numpy(),
        "logp_finite": torch.where(on, torch.isfinite(logp), torch.ones_like(on)).all(1).numpy(),
        "logp_max": torch.where(on & torch.isfinite(logp), logp, torch.full_like(logp, -math.inf)).amax(1).clamp_min(-1e30).double().numpy(),
        "loss_on_unsampled": ((on & ~(sampled > 0)).sum(1) if sampled is not None
                              else torch.zeros(b, dtype=torch.long)).numpy(),
    })
    try:
        BatchRows.validate(rows, lazy=True)
    except pa.errors.SchemaErrors as exc:
        raise BatchValidationError("tensor batch", failures_frame(exc), rows) from None


# ---------------------------------------------------------------------------- OPD: the teacher's scores

class TeacherRows(pa.DataFrameModel):
    """Per-row summary of `batch.teacher_logp` on the loss tokens, for the pandera gate."""

    row: Series[int]
    teacher_present: Series[bool] = pa.Field(isin=[True])
    teacher_logp_finite: Series[bool] = pa.Field(isin=[True])
    teacher_logp_max: Series[float] = pa.Field(le=1e-6)


def validate_teacher_logp(batch) -> None:
    """The gate's check of the teacher annotation: present, `[B, T]`, finite and ≤ 0 on every loss token.

    Raises `BatchValidationError` (a ValueError) naming the failing checks and rows. Run it with the
    other gate checks (`validate_batch_tensors`) before dispatch (`tasks.teacher`).
    """
    t = getattr(batch, "teacher_logp", None)
    b = batch.batch_size
    if t is None or tuple(t.shape) != tuple(batch.loss_mask.shape):
        got = "missing" if t is None else f"shape {list(t.shape)}"
        why = (f"{got}; expected {list(batch.loss_mask.shape)} (score the batch with "
               "rl_core.algorithms.opd.teacher_logprobs)")
        failures = pd.DataFrame([("present", "teacher_logp", None, why)],
                                columns=["check", "column", "index", "failure_case"])
        raise BatchValidationError("teacher log-probs", failures)
    on = batch.loss_mask > 0
    logp = t.float()
    finite = torch.where(on, torch.isfinite(logp), torch.ones_like(on)).all(-1)
    top = torch.where(on & torch.isfinite(logp), logp, torch.full_like(logp, -math.inf)).amax(-1) if t.shape[1] else \
        torch.full((b,), -math.inf)
    rows = pd.DataFrame({
        "row": np.arange(b, dtype=np.int64),
        "teacher_present": np.ones(b, dtype=bool),
        "teacher_logp_finite": finite.numpy(),
        "teacher_logp_max": top.clamp_min(-1e30).double().numpy(),
    })
    try:
        TeacherRows.validate(rows, lazy=True)
    except pa.errors.SchemaErrors as exc:
        raise BatchValidationError("teacher log-probs", failures_frame(exc), rows) from None


# ---------------------------------------------------------------------------- DPO: preference pairs

class PreferencePairsError(BatchValidationError):
    """Preference pairs refused by the gate; `.failures` lists (check, column, index, failure_case)."""


class PreferencePairs(pa.DataFrameModel):
    """One row per preference pair."""

    pair_id: Series[int] = pa.Field(ge=0, unique=True)
    prompt: Series[str] = pa.Field()
    chosen: Series[str] = pa.Field()
    rejected: Series[str] = pa.Field()

    class Config:
        strict = False  # extra columns (e.g. "source") are kept
        coerce = False

    @pa.check("prompt", "chosen", "rejected", name="non_empty")
    def _non_empty(cls, s: Series[str]) -> Series[bool]:
        return s.astype(str).str.strip().str.len() > 0

    @pa.dataframe_check(name="chosen!=rejected")
    def _different(cls, df: pd.DataFrame) -> Series[bool]:
        return df["chosen"].astype(str).str.strip() != df["rejected"].astype(str).str.strip()


def preference_pairs_schema(*, max_prompt_tokens: int | None = None,
                            max_response_tokens: int | None = None) -> pa.DataFrameSchema:
    """`PreferencePairs` plus token-length columns bounded by the given limits (None: unbounded)."""
    schema = PreferencePairs.to_schema()
    columns = {}

    def at_most(col: str, limit: int, param: str) -> pa.Column:
        return pa.Column(int, pa.Check(lambda s, n=int(limit): s <= n, name=f"{col}<={param}({limit})"))

    if max_prompt_tokens is not None:
        columns["prompt_tokens"] = at_most("prompt_tokens", max_prompt_tokens, "max_prompt_tokens")
    if max_response_tokens is not None:
        for col in ("chosen_tokens", "rejected_tokens"):
            columns[col] = at_most(col, max_response_tokens, "max_response_tokens")
    return schema.add_columns(columns) if columns else schema


def validate_pair_table(df: pd.DataFrame, *, max_prompt_tokens: int | None = None,
                        max_response_tokens: int | None = None) -> pd.DataFrame:
    """`preference_pairs_schema` over a pair frame (with `pair_id` and, for limits, token-length columns);
    raises PreferencePairsError naming each failing check."""
    schema = preference_pairs_schema(max_prompt_tokens=max_prompt_tokens, max_response_tokens=max_response_tokens)
    try:
        return schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as exc:
        raise PreferencePairsError("preference pairs", failures_frame(exc), df) from None
