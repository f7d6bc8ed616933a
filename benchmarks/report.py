"""Each benchmark's section of docs/benchmarks.md, rewritten from the figures it just measured.

A benchmark ends with `write_section(name, header, rows)`: the text between `<!-- bench:NAME -->` and
`<!-- /bench:NAME -->` in docs/benchmarks.md becomes the command that ran, the machine it ran on (CPU
model, cores, RAM, GPU, torch when loaded), the date, the table and any notes. What the benchmark
measures is written outside the markers and is not touched. A section without markers yet is added at
the end of the page. `POSTTRAIN_BENCH_REPORT=0` prints the section instead of writing it.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(×|x|%|ms|s|MB|MiB|GiB)?$")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this benchmark, as a user would type it from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        script_text = str(script.relative_to(REPO))
    except ValueError:
        script_text = argv[0]
    return " ".join(["python", script_text, *(shlex.quote(a) for a in argv[1:])])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _gpus() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU"
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if not names:
        return "no GPU"
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} × {name}" for name, n in counts.items())


def machine() -> str:
    """One line: CPU model, cores, RAM, GPUs, and torch's version when the benchmark has loaded it."""
    ram = _ram_gib()
    parts = [_cpu_model(), f"{os.cpu_count()} cores", f"{ram:.0f} GiB RAM" if ram else "RAM unknown", _gpus()]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; a column whose every cell is a number (units allowed) is right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    numeric = [bool(cells) and all(_NUMBER.match(row[i].strip()) or row[i].strip() in ("-", "–") for row in cells)
               for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def render(header: Sequence[str], rows: Sequence[Sequence[object]], notes: Sequence[str] = (),
           command: str | None = None, when: datetime.date | None = None) -> str:
    """The body of a section: command, machine and date, table, notes."""
    when = when or datetime.datetime.now(datetime.UTC).date()
    parts = [f"    {command or command_line()}", f"Measured {when.isoformat()} on {machine()}.", table(header, rows)]
    parts += [note for note in notes if note]
    return "\n\n".join(parts)


def write_section(name: str, header: Sequence[str], rows: Sequence[Sequence[object]], notes: Sequence[str] = (),
                  doc: Path = DOC) -> str:
    """Replace section `name` of `doc` with the rendered figures (printed instead when POSTTRAIN_BENCH_REPORT=0)."""
    body = render(header, rows, notes)
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body}\n{end}"
    if os.environ.get("POSTTRAIN_BENCH_REPORT", "1") == "0" or not doc.parent.is_dir():
        print(block)
        return block
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## `{name}`\n\n{block}\n"
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)
    print(f"({doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc}: section {name} rewritten)")
    return block
