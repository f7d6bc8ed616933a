"""The CLI's live view of a run (step, reward, loss, accuracy, tokens/s, time left) with rich."""

from __future__ import annotations

import sys
from typing import Any, Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# The time left is rich's: steps still to run / the step rate over this window (evaluations and checkpoints
# included), so a run of minutes-long steps still has several steps in it.
ETA_WINDOW_S = 3600.0


class RunProgress:
    """A rich progress bar on a terminal; a plain line every `every` steps elsewhere (logs, workers)."""

    def __init__(self, total: int, name: str, start: int = 0, every: int = 10, clock=None):
        """`clock`: seconds now (default: the console's monotonic clock); the time left is measured with it."""
        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.every = every
        self.total = total
        self.progress = Progress(
            TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console, disable=not self.live,
            speed_estimate_period=ETA_WINDOW_S, get_time=clock,
        )
        self.task = self.progress.add_task(name, total=total, completed=start, stats="")
        self.last_acc: float | None = None

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, record: dict[str, Any]) -> None:
        if "val/accuracy" in record:
            self.last_acc = record["val/accuracy"]
        parts = []
        if "rollout/reward_mean" in record:
            parts.append(f"reward {record['rollout/reward_mean']:.3f}")
        for key in ("train/reward_accuracy", "train/accuracy"):  # DPO, a reward model: their pairs' accuracy instead
            if key in record:
                parts.append(f"pref acc {record[key]:.2f}")
        if "train/loss" in record:
            parts.append(f"loss {record['train/loss']:+.4f}")
        if self.last_acc is not None:
            parts.append(f"acc {self.last_acc:.3f}")
        if "perf/tokens_per_s" in record:
            parts.append(f"{record['perf/tokens_per_s']:,.0f} tok/s")
        stats = " | ".join(parts)
        step = record["step"]
        self.progress.update(self.task, completed=step, stats=stats)
        if not self.live and (step % self.every == 0 or step == self.total or "val/accuracy" in record):
            eta = self.eta()
            print(f"step {step}/{self.total}: {stats}{f' | eta {eta}' if eta else ''}", file=sys.stderr, flush=True)

    def eta(self) -> str | None:
        """The time left as H:MM:SS (rich's estimate), or None before two steps have been timed or at the end."""
        task = self.progress.tasks[0]
        left = task.time_remaining
        if left is None or task.finished:
            return None
        minutes, seconds = divmod(int(left), 60)
        return f"{minutes // 60:d}:{minutes % 60:02d}:{seconds:02d}"
