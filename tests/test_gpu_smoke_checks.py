"""benchmarks/gpu_smoke.py's reading of a finished run (`check_run`), on run outputs written here: a healthy
colocated run passes; memory that grows over the sleep/wake cycles, a trainer rank without TF32, a vLLM that does
not give back its memory, and an engine that keeps more asleep than the memory plan counts are each named. And
tools/gpu_driver.py, which `make gpu-smoke` runs before it installs anything, on nvidia-smi outputs made here: a
driver too old for the CUDA build of the GPU lock's torch and vLLM is named, a machine without a GPU stops cleanly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import gpu_smoke
finally:
    sys.path.remove(str(REPO / "benchmarks"))

GPU_GIB = 80.0


def write_run(run_dir: Path, *, asleep=(10.0, 10.1, 10.2), rollout=(40.0, 40.0, 40.1), precision="high",
              resident=0.6) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = [{"step": s, "train/loss": 0.1, "train/grad_norm": 0.5, "rollout/logp_abs_diff": 0.01,
              "rollout/logp_abs_diff_max": 0.1, "rollout/sync_probe_logp_abs_diff": 0.02, "rollout/reward_mean": 0.5,
              "rollout/response_len_mean": 100.0, "perf/generate_s": 1.0, "perf/weight_sync_s": 0.1,
              "perf/tokens_per_s": 1000.0, "perf/gpu_rollout_used_gib": rollout[s - 1],
              "perf/gpu_asleep_used_gib": asleep[s - 1], "perf/gpu_train_peak_gib": 30.0} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    placement = {"trainers": [{"device": "cuda:0", "float32_matmul_precision": precision,
                               "vllm_asleep_resident_gib": resident}]}
    (run_dir / "placement.json").write_text(json.dumps(placement))
    return run_dir


def test_a_healthy_colocated_run_passes(tmp_path):
    assert gpu_smoke.check_run(write_run(tmp_path / "ok"), 3, True, GPU_GIB) == []


def test_growth_over_the_cycles_a_trainer_without_tf32_and_memory_not_given_back_are_named(tmp_path):
    grew = gpu_smoke.check_run(write_run(tmp_path / "grew", asleep=(10.0, 10.3, 10.6)), 3, True, GPU_GIB)
    assert len(grew) == 1 and "in use asleep grew over the sleep/wake cycles: [10.0, 10.3, 10.6]" in grew[0]
    leak = gpu_smoke.check_run(write_run(tmp_path / "leak", rollout=(40.0, 41.0, 42.0)), 3, True, GPU_GIB)
    assert len(leak) == 1 and "at rollout grew" in leak[0]
    highest = gpu_smoke.check_run(write_run(tmp_path / "fp32", precision="highest"), 3, True, GPU_GIB)
    assert len(highest) == 1 and "['highest']: TF32" in highest[0]
    # a reservation of 0.3 x 80 GiB = 24 GiB: sleeping must free at least half of it
    kept = gpu_smoke.check_run(write_run(tmp_path / "kept", asleep=(35.0, 35.0, 35.0)), 3, True, GPU_GIB)
    assert len(kept) == 1 and "gave back only [5.0, 5.0, 5.1" in kept[0]
    # what sleep leaves (CUDA graphs, buffers) above the plan's 1 GiB for it, or not measured at all
    graphs = gpu_smoke.check_run(write_run(tmp_path / "graphs", resident=1.5), 3, True, GPU_GIB)
    assert len(graphs) == 1 and "keeps [1.5] GiB on the GPU asleep; the memory plan counts 1.00" in graphs[0]
    unmeasured = gpu_smoke.check_run(write_run(tmp_path / "unmeasured", resident=None), 3, True, GPU_GIB)
    assert len(unmeasured) == 1 and "[None]" in unmeasured[0]


def test_what_a_sleeping_engine_keeps_is_held_to_the_plan_s_figure_for_the_run_s_model(tmp_path):
    """The plan scales what a sleeping vLLM keeps with the model (never below 1 GiB): make gpu-smoke compares the
    measurement with the figure for the model it ran, not a constant."""
    from rl_core.placement.formulas import GIB, vllm_asleep_bytes
    from rl_core.placement.model_shape import ModelShape

    big = write_run(tmp_path / "big", resident=1.3)
    assert len(gpu_smoke.check_run(big, 3, True, GPU_GIB)) == 1  # above the floor
    assert gpu_smoke.check_run(big, 3, True, GPU_GIB, asleep_plan_gib=1.39) == []
    said = gpu_smoke.check_run(big, 3, True, GPU_GIB, asleep_plan_gib=1.25)
    assert len(said) == 1 and "the memory plan counts 1.25" in said[0] and "vllm_asleep_bytes" in said[0]
    llama_70b = ModelShape(n_params=1, n_param_tensors=1, hidden_size=8192, num_layers=80, num_heads=64,
                           num_kv_heads=8, head_dim=128, intermediate_size=28672, vocab_size=32000)
    assert vllm_asleep_bytes(llama_70b, 2) > 1.3 * GIB  # a model that large is planned above the floor
    assert gpu_smoke.planned_asleep_gib(tmp_path / "no-model-here") == 1.0  # no config.json: the floor


# ------------------------------------------------------- tools/gpu_driver.py: before make gpu-smoke installs

def _gpu_driver():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_driver
    finally:
        sys.path.remove(str(REPO / "tools"))
    return gpu_driver


H100_QUERY = "NVIDIA H100 80GB HBM3, 580.95.05, 9.0\n"
BANNER = ("+-----------------------------------------------------------------------------------------+\n"
          "| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |\n")


def fake_smi(query: str | None, banner: str = "", rc: int = 0):
    """A stand-in for `subprocess.run` of nvidia-smi: its CSV query answer and its banner (None: no nvidia-smi)."""
    def run(args):
        if query is None:
            raise FileNotFoundError("nvidia-smi")
        return rc, (query if any(a.startswith("--query-gpu") for a in args) else banner)
    return run


def test_driver_versions_compare_as_numbers():
    d = _gpu_driver()
    assert d.version_tuple("580.65.06") == (580, 65, 6) and d.version_tuple("13.0") == (13, 0)
    assert d.version_tuple("580.105.08") > d.version_tuple("580.65.06") > d.version_tuple("575.100.99")
    assert d.version_tuple("590.1") > d.version_tuple("580.65.06")  # fewer parts: compared as written


def test_a_new_enough_driver_passes_and_an_old_one_is_named_with_what_the_wheels_need():
    d = _gpu_driver()
    rc, message = d.check(fake_smi(H100_QUERY, BANNER.format(driver="580.95.05", cuda="13.0")))
    assert rc == 0 and "NVIDIA H100 80GB HBM3: driver 580.95.05 (CUDA 13.0)" in message, message
    old = "NVIDIA A100-SXM4-80GB, 550.54.15, 8.0\n"
    rc, message = d.check(fake_smi(old, BANNER.format(driver="550.54.15", cuda="12.4")))
    assert rc == 1, message
    assert "driver 550.54.15 is older than 580.65.06" in message and "CUDA 13.0" in message
    assert "torch 2.13.0" in message and "vllm 0.32.0" in message and "nothing was installed" in message
    # the driver's own CUDA version, where the banner gives one, is checked too
    rc, message = d.check(fake_smi(H100_QUERY, BANNER.format(driver="580.95.05", cuda="12.8")))
    assert rc == 1 and "supports CUDA 12.8" in message
    # a GPU older than CUDA 13.0 builds code for (Volta), even on a new driver
    rc, message = d.check(fake_smi("Tesla V100-SXM2-32GB, 580.95.05, 7.0\n"))
    assert rc == 1 and "compute capability 7.0" in message and "7.5" in message
    # every GPU is checked: one old one among new ones fails
    rc, message = d.check(fake_smi(H100_QUERY + "Tesla V100-SXM2-32GB, 580.95.05, 7.0\n"))
    assert rc == 1 and "GPU 1" in message


def test_no_nvidia_smi_or_no_gpu_stops_cleanly_before_the_install():
    d = _gpu_driver()
    rc, message = d.check(fake_smi(None))
    assert rc == 2 and "no NVIDIA GPU" in message and "nothing to install" in message
    rc, message = d.check(fake_smi("No devices were found\n", rc=6))
    assert rc == 2 and "no NVIDIA GPU" in message
    rc, message = d.check(fake_smi("", rc=0))
    assert rc == 2
    # a driver nvidia-smi cannot reach is a GPU machine to fix, not one without a GPU
    broken = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    rc, message = d.check(fake_smi(broken, rc=9))
    assert rc == 1 and "couldn't communicate" in message


def test_the_driver_check_names_the_torch_of_the_gpu_lock():
    """The minimum driver belongs to the CUDA build of constraints-gpu.txt's torch and vllm: a version bump there must
    revisit it."""
    d = _gpu_driver()
    pins = dict(line.split("==", 1) for line in (REPO / "constraints-gpu.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert (pins["torch"], pins["vllm"]) == (d.TORCH, d.VLLM), "constraints-gpu.txt moved: revisit tools/gpu_driver.py"


@pytest.mark.e2e  # make and a subprocess
@pytest.mark.parametrize("smi, rc, says", [
    ("echo 'No devices were found'; exit 6", 0, "no NVIDIA GPU"),
    ("echo 'NVIDIA A100-SXM4-80GB, 550.54.15, 8.0'", 2, "older than 580.65.06"),
])
def test_make_gpu_smoke_checks_the_driver_before_it_installs(tmp_path, smi, rc, says):
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    venv = blocker / "venv-gpu"  # a venv that cannot be made: were the check skipped, make would fail here, fast
    run = subprocess.run(["make", "--no-print-directory", "gpu-smoke", f"GPU_VENV={venv}"], cwd=REPO,
                         env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == rc and says in run.stdout + run.stderr, run.stdout + run.stderr
    assert str(venv) not in run.stdout + run.stderr  # stopped before the venv and its install
