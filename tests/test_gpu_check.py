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


def test_a_carried_wheel_is_imported_from(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_check import use_wheels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
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
