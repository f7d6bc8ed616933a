"""The training curves of a run as one titled multi-panel PNG (matplotlib, Agg, no pyplot global state).

`PANELS` is the one table of what is drawn: each panel names the metrics.jsonl keys it plots, and a panel
is drawn only when the run logged at least one of them (legacy_pg logs no clip fraction, DPO no reward).
Per-step series are drawn raw (faint) under an exponential moving average (`ema`, pandas' `ewm`); the
reward panel adds the band mean ± std (both smoothed) of the batch's rewards. Held-out (`val/*`) values are
sparse and drawn as they are. `posttrain summarize` writes the same series to curve.json for `dvc plots`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CURVE_KEYS = ("rollout/reward_mean", "val/accuracy")  # the two headline series: the first two panels
MAX_SPAN = 50  # the longest EMA window, in steps


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    keys: tuple[str, ...]  # metrics.jsonl keys, one line each
    band: str | None = None  # a std key: the band keys[0] ± band


PANELS: tuple[Panel, ...] = (
    Panel("reward (mean ± std over the batch)", "reward", ("rollout/reward_mean",), band="rollout/reward_std"),
    Panel("held-out accuracy", "fraction correct", ("val/accuracy", "val/reward_accuracy")),
    Panel("loss", "loss", ("train/loss", "val/loss")),
    Panel("KL divergence", "nats / token", ("train/kl", "train/reverse_kl", "train/approx_kl_old")),
    Panel("entropy", "nats / token", ("train/entropy",)),
    Panel("response length", "tokens / completion", ("rollout/response_len_mean", "rollout/response_len_max")),
    Panel("truncation", "fraction cut at max_tokens", ("rollout/truncation_rate",)),
    Panel("clip fraction", "fraction of loss tokens", ("train/clip_frac", "train/clip_frac_low",
                                                        "train/clip_frac_high")),
    Panel("grad norm", "global L2 norm, before clipping", ("train/grad_norm",)),
)


def metric_value(value: Any) -> float | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(records: Iterable[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of `key` (records without it, or with null, NaN or infinity, are skipped)."""
    points = [(r["step"], x) for r in records if (x := metric_value(r.get(key))) is not None]
    return [s for s, _ in points], [x for _, x in points]


def smoothing_span(n: int) -> int:
    """The EMA span for a series of `n` points: a tenth of it, 1 (no smoothing) to `MAX_SPAN`."""
    return max(1, min(MAX_SPAN, n // 10))


def ema(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average, y_0 = x_0, y_t = (1 - a) y_(t-1) + a x_t with a = 2 / (span + 1)."""
    import pandas as pd

    return pd.Series(values, dtype="float64").ewm(span=span, adjust=False).mean().tolist()


def panels_present(records: Sequence[dict[str, Any]]) -> list[Panel]:
    """The panels of `PANELS` that have data in `records`."""
    logged = {key for r in records for key, v in r.items() if metric_value(v) is not None}
    return [p for p in PANELS if logged.intersection(p.keys)]


def _draw(ax, records: Sequence[dict[str, Any]], panel: Panel) -> None:
    for key in panel.keys:
        steps, values = series(records, key)
        if not steps:
            continue
        if key.startswith("val/"):  # sparse held-out evaluations: drawn as measured
            ax.plot(steps, values, marker="o", markersize=3, label=key)
            continue
        span = smoothing_span(len(values))
        smoothed = ema(values, span)
        (line,) = ax.plot(steps, smoothed, linewidth=1.5, label=f"{key} (EMA {span})" if span > 1 else key)
        if span > 1:
            ax.plot(steps, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
        if panel.band and key == panel.keys[0]:
            std = dict(zip(*series(records, panel.band), strict=True))
            band = [(s, m, std[s]) for s, m in zip(steps, values, strict=True) if s in std]
            if band:
                band_span = smoothing_span(len(band))
                mean_s, std_s = ema([m for _, m, _ in band], band_span), ema([d for _, _, d in band], band_span)
                ax.fill_between([s for s, _, _ in band], [m - d for m, d in zip(mean_s, std_s, strict=True)],
                                [m + d for m, d in zip(mean_s, std_s, strict=True)], color=line.get_color(),
                                alpha=0.15, linewidth=0, label=f"± {panel.band}")
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(loc="best", fontsize=7)


def curve_figure(records: Iterable[dict[str, Any]], title: str | None = None):
    """A matplotlib `Figure`: one axis per panel present in `records`, titled `title` (job name and objective)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    records = list(records)
    panels = panels_present(records)
    ncols = 4 if len(panels) in (7, 8) else min(3, max(1, len(panels)))  # 7 or 8: two rows of four
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(4.2 * ncols, 3.0 * nrows + 0.5), dpi=72, layout="constrained")
    fig.suptitle(title or "training curves", fontsize=12)
    for i, panel in enumerate(panels):
        _draw(fig.add_subplot(nrows, ncols, i + 1), records, panel)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
    return fig


def curve_title(job_name: str, objective: str) -> str:
    """The figure's title: which run, trained with which objective."""
    return f"{job_name} — {objective}"


def plot_curve(records: Iterable[dict[str, Any]], path_png: str | os.PathLike, title: str | None = None) -> Path:
    """Write the multi-panel figure of `records` (metrics.jsonl records) to `path_png`."""
    out = Path(path_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    curve_figure(records, title).savefig(out, format="png", pil_kwargs={"optimize": True})
    return out
