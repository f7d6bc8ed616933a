"""Where a run's numbers go: `runs/<job.name>/metrics.jsonl`, one JSON line per step.

Every key is a stable public name (`train/*`, `rollout/*`, `perf/*`, `val/*`). Later layers (MLflow,
DVC metrics, plots) read this file rather than keeping numbers of their own.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra.checkpoints.store import write_durably
from rl_core.atomic import fsync_dir

log = logging.getLogger("posttrain.tracking")


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsLog:
    """Append-only JSONL metrics file; each line is flushed and fsynced so a crash loses no step."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def line(record: dict[str, Any]) -> str:
        """One record as its metrics.jsonl line (no newline)."""
        return json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False)

    def append(self, record: dict[str, Any]) -> None:
        line = self.line(record)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read(self) -> list[dict[str, Any]]:
        """Every record. A torn LAST line (a write cut by a crash: no newline, not JSON) is skipped, since
        the step it belonged to is redone on resume; a bad line anywhere else is an error naming it."""
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) and not text.endswith("\n"):
                    log.warning("%s: the last line is torn (a write cut by a crash); its step is redone", self.path)
                    continue
                raise ValueError(f"{self.path}:{i}: not a JSON record ({exc.msg}); fix or remove that line") from None
        return out

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8") if self.path.exists() else ""

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run rewrites the steps after its checkpoint)."""
        self.replace([r for r in self.read() if r.get("step", -1) <= step])

    def replace(self, records: Iterable[dict[str, Any]]) -> None:
        """Rewrite the file with exactly `records` (atomically: a temporary file, then rename)."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        write_durably(tmp, "".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

