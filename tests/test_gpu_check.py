"""benchmarks/gpu_check.py, the GPU check for a bare GPU image, in its CPU dry run: every check passes on CPU, and
the script imports nothing such an image lacks (Ray, Prefect, MLflow, vLLM, pandera, datasets, TRL, boto3, DVC),
checked by running it with those imports refused; its wheel loader imports a package from a wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
ABSENT = ("ray", "prefect", "mlflow", "vllm", "pandera", "datasets", "trl", "boto3", "dvc")
# the dry run with the packages a bare GPU image lacks made absent: None in sys.modules makes `import` fail and
# `importlib.util.find_spec` (the availability checks of transformers and accelerate) answer None, as when not installed
BARE_IMAGE = f"""
import runpy, sys
sys.modules.update(dict.fromkeys({ABSENT!r}))
sys.argv = [{str(SCRIPT)!r}, *sys.argv[1:]]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
"""


@pytest.mark.e2e  # a subprocess
def test_the_dry_run_passes_every_check_without_what_a_bare_gpu_image_lacks(tmp_path):
    run = subprocess.run([sys.executable, "-c", BARE_IMAGE, "--cpu-dry-run", "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["precision", "train_step", "export", "fsdp", "dcp"]
    assert all(c["ok"] for c in checks.values()), checks
    assert report["device"] == "cpu (dry run)"
    # on CPU the trainer's float32 matmuls stay "highest", and stay so after an engine resets them
    assert checks["precision"]["after_enable_tf32"] == checks["precision"]["after_engine_start"] == "highest"
    step = checks["train_step"]
    assert step["float32_masters"] and step["parameters_changed"].split("/")[0] == step["parameters_changed"].split("/")[1]
    assert step["loss_tokens"] > 0 and step["tokens_per_s"] > 0 and step["rows"] == 2 * 4
    assert 0 < step["plan_resident_bytes"] < step["plan_step_peak_bytes"]
    assert "measured_step_peak_bytes" not in step  # no device memory on CPU
    assert checks["export"]["logp_max_abs_diff"] <= 1e-5 and "model.safetensors" in checks["export"]["files"]
    assert checks["fsdp"]["backend"] == "gloo" and checks["fsdp"]["differ_from_plain_load"] == []
    assert checks["dcp"]["differ"] == [] and checks["dcp"]["bytes"] > 0


@pytest.mark.e2e  # a subprocess
def test_without_a_gpu_or_the_dry_run_it_stops_and_says_how():
    import os

    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine that has one
    run = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True, timeout=300,
                         env=hidden)
    assert run.returncode == 2 and "--cpu-dry-run" in run.stderr


def _gpu_wheels():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_wheels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return gpu_wheels


def test_a_carried_wheel_is_imported_from(tmp_path, monkeypatch):
    use_wheels = _gpu_wheels().use_wheels
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried_demo-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("carried_demo/__init__.py", "VALUE = 41 + 1\n")
        whl.writestr("carried_demo-1.0.dist-info/METADATA", "Name: carried-demo\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert use_wheels(wheels, tmp_path / "unpacked") == ["carried_demo-1.0-py3-none-any.whl"]
    import carried_demo

    assert carried_demo.VALUE == 42 and Path(carried_demo.__file__).is_relative_to(tmp_path / "unpacked")
    sys.modules.pop("carried_demo")
    with pytest.raises(SystemExit, match="no \\*.whl files"):
        use_wheels(tmp_path / "unpacked", tmp_path / "again")


def _lock() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))


def test_the_carried_wheels_are_the_locked_pydantic_and_its_matching_core():
    """The wheels a bare image gets are constraints.txt's pydantic, the pydantic-core that pydantic release requires,
    and their pure dependencies, each pinned (an unpinned download pairs the newest of each, which may not match), and
    the documented command is the helper that downloads exactly those."""
    wheels, lock = _gpu_wheels(), _lock()
    pins = wheels.wheel_pins()
    assert pins == {name: lock[name] for name in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                                                  "typing-extensions")}
    command = wheels.download_command(Path("gpu-wheels"), "3.12")
    assert f"pydantic=={lock['pydantic']}" in command and f"pydantic-core=={lock['pydantic-core']}" in command
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    assert all("==" in arg for arg in command[command.index("gpu-wheels") + 1:])  # every package pinned
    from importlib.metadata import distribution

    assert f"pydantic-core=={lock['pydantic-core']}" in distribution("pydantic").requires  # the pair matches
    docs = (REPO / "docs" / "gpu.md").read_text()
    assert "benchmarks/gpu_check.py --download-wheels gpu-wheels" in docs
    assert "pydantic pydantic-core" not in docs  # no unpinned download left in the docs


def _fake_dist(root: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_a_pydantic_core_other_than_the_one_pydantic_requires_is_named(tmp_path):
    problem = _gpu_wheels().pydantic_problem
    good, bad, lone = tmp_path / "good", tmp_path / "bad", tmp_path / "lone"
    _fake_dist(good, "pydantic", "2.14.4", ("pydantic-core==2.50.5", "typing-extensions>=4.14.1"))
    _fake_dist(good, "pydantic-core", "2.50.5")
    assert problem([str(good)]) is None
    _fake_dist(bad, "pydantic", "2.14.4", ("pydantic-core==2.50.5",))
    _fake_dist(bad, "pydantic-core", "2.46.4")
    said = problem([str(bad)])
    assert "pydantic 2.14.4 requires pydantic-core==2.50.5" in said and "2.46.4" in said and "--download-wheels" in said
    _fake_dist(lone, "pydantic", "2.14.4", ("pydantic-core==2.50.5",))
    assert "no pydantic-core" in problem([str(lone)])
    assert "no pydantic" in problem([str(tmp_path / "empty")])


@pytest.mark.e2e  # a subprocess
def test_mismatched_wheels_stop_the_check_with_a_report_not_a_traceback(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, version, requires in (("pydantic", "2.14.4", "Requires-Dist: pydantic-core==2.50.5\n"),
                                    ("pydantic_core", "2.46.4", "")):
        with zipfile.ZipFile(wheels / f"{name}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{name}/__init__.py", "raise SystemError('imported')\n")
            whl.writestr(f"{name}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--wheels", str(wheels),
                          "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "pydantic 2.14.4 requires pydantic-core==2.50.5" in report["error"] and "2.46.4" in report["error"]
    assert report["checks"] == {} and "pydantic-core" in run.stderr
