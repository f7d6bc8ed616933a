"""The learning curve of a run as a PNG (matplotlib, Agg, no pyplot global state)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra.metrics_log import last_values

CURVE_KEYS = ("rollout/reward_mean", "val/accuracy")


def metric_value(value: Any) -> float | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None



def plot_curve(records: Iterable[dict[str, Any]], path_png: str | os.PathLike,
               keys: Iterable[str] = CURVE_KEYS) -> Path:
    """Write a PNG of `rollout/reward_mean` and `val/accuracy` against step (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    records = list(records)
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    for key in keys:
        points = [(s, v) for s, v in last_values(records, key) if metric_value(v) is not None]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None,
                    label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(loc="best")
    out = Path(path_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
