"""Where a run's numbers go: `runs/<job.name>/metrics.jsonl`, one JSON line per step.

Every key is a stable public name (`train/*`, `rollout/*`, `perf/*`, `val/*`). Later layers (MLflow,
DVC metrics) read this file rather than keeping numbers of their own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable


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

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    def truncate_after(self, step: int) -> None:
        """Drop lines past `step` (a resumed run rewrites the steps after its checkpoint)."""
        keep = [r for r in self.read() if r.get("step", -1) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)


def last_values(records: Iterable[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
