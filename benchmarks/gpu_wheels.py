"""The wheels benchmarks/gpu_check.py carries to a bare GPU image: pydantic (rl_core's config), the pydantic-core that
pydantic release requires, and their pure dependencies, at constraints.txt's versions.

pydantic pins one pydantic-core release exactly (`pydantic 2.14.4` requires `pydantic-core==2.50.5`) and refuses to
import beside any other (a `SystemError` on import, so the check would stop with a traceback and no report). An
unpinned download pairs the newest of each, which need not match; `download_command` pins all five from the lock,
and `pydantic_problem` checks the pair (from the distributions' metadata, without importing them) before the check
imports anything.

    python benchmarks/gpu_check.py --download-wheels gpu-wheels --python-version 3.12   # where there is a network
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
PLATFORM = "manylinux2014_x86_64"  # pydantic-core's Linux x86_64 wheels carry this tag; the others are pure Python


def wheel_pins(constraints: Path = REPO / "constraints.txt") -> dict[str, str]:
    """{package: version} of `WHEEL_PACKAGES` in the lock: the pydantic the tests ran, and its pydantic-core."""
    pins = dict(line.split("==", 1) for line in constraints.read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    return {name: pins[name] for name in WHEEL_PACKAGES}


def download_command(dest: Path, python_version: str) -> list[str]:
    """`pip download` of the pinned wheels for a GPU image's Python (`3.12`), Linux x86_64, into `dest`."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--python-version",
            python_version, "--platform", PLATFORM, "-d", str(dest),
            *(f"{name}=={version}" for name, version in wheel_pins().items())]


def use_wheels(directory: Path, into: Path) -> list[str]:
    """Unpack every wheel in `directory` into `into` and put it first on `sys.path` (a wheel is a zip of its
    packages: pure-Python ones import from there, and so do compiled ones once unpacked). Returns the wheels."""
    names = sorted(p.name for p in directory.glob("*.whl"))
    if not names:
        raise SystemExit(f"--wheels {directory}: no *.whl files there")
    for name in names:
        with zipfile.ZipFile(directory / name) as wheel:
            wheel.extractall(into)
    sys.path.insert(0, str(into))
    return names


def pydantic_problem(path: list[str] | None = None) -> str | None:
    """Why pydantic would not import with the pydantic-core found first on `path` (default `sys.path`): missing, or
    not the release pydantic requires. None when the pair matches. Reads the metadata only."""
    from importlib.metadata import distributions

    def first(name: str):
        return next(iter(distributions(name=name, path=sys.path if path is None else path)), None)

    fix = ("carry the pinned pair: python benchmarks/gpu_check.py --download-wheels DIR --python-version X.Y where "
           "there is a network, then --wheels DIR here")
    pydantic = first("pydantic")
    if pydantic is None:
        return f"no pydantic here (rl_core's config needs it): {fix}"
    wanted = next((m.group(1) for line in pydantic.requires or ()
                   if (m := re.match(r"pydantic[-_]core\s*==\s*([^\s;,]+)", line, re.IGNORECASE))), None)
    core = first("pydantic-core") or first("pydantic_core")
    if core is None:
        return f"no pydantic-core here (pydantic {pydantic.version} requires pydantic-core=={wanted}): {fix}"
    if wanted is not None and core.version != wanted:
        return (f"pydantic {pydantic.version} requires pydantic-core=={wanted}, but pydantic-core {core.version} is "
                f"the one found first ({core.locate_file('')}): pydantic refuses to import beside it; {fix}")
    return None
