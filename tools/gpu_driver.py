"""Before `make gpu-smoke` installs anything: can this machine's NVIDIA driver and GPUs run the CUDA build that
constraints-gpu.txt installs?

PyPI's Linux wheel of torch 2.13.0 (constraints-gpu.txt's torch) is built for CUDA 13.0 (it requires
cuda-toolkit==13.0.3 and nvidia-*-cu13 packages), and vLLM 0.32.0's GPU wheel is built against that torch (its
kernels are the cu13 ones). CUDA 13.0 needs:

- a Linux driver of at least 580.65.06 (NVIDIA's CUDA 13.0 release notes: the minimum driver of CUDA 13.0 GA); an
  older one fails at the first CUDA call, after a multi-GB install;
- a GPU of compute capability 7.5 or more: CUDA 13.0 builds no code for Maxwell, Pascal or Volta (sm_50 to sm_72).

`nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader` gives each GPU's name, driver and
compute capability, and nvidia-smi's banner the newest CUDA the driver supports ("CUDA Version: 13.0"), checked too
where it is printed. Standard library only: it runs with the system's python3, before any venv exists.

Exit status: 0 the driver and every GPU can run it; 1 they cannot, or nvidia-smi cannot reach the driver (the
message says what is needed; nothing is installed); 2 no NVIDIA GPU here (no nvidia-smi, or it finds no device):
`make gpu-smoke` says so and stops, successfully, before the install.

    python3 tools/gpu_driver.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

TORCH, VLLM = "2.13.0", "0.32.0"  # constraints-gpu.txt's (tests/test_gpu_smoke_checks.py checks they agree)
CUDA = (13, 0)  # what PyPI's Linux wheel of that torch is built for
MIN_DRIVER = "580.65.06"  # CUDA 13.0's minimum Linux driver
MIN_COMPUTE_CAPABILITY = (7, 5)  # CUDA 13.0 dropped Maxwell, Pascal and Volta
QUERY = ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"]
Runner = Callable[[list[str]], tuple[int, str]]


def version_tuple(text: str) -> tuple[int, ...]:
    """`580.65.06` -> `(580, 65, 6)`: driver and CUDA versions compare as numbers, part by part."""
    return tuple(int(part) for part in re.findall(r"\d+", text))


def _run(args: list[str]) -> tuple[int, str]:
    """nvidia-smi's exit status and output (FileNotFoundError: no nvidia-smi)."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def check(run: Runner = _run) -> tuple[int, str]:
    """`(exit status, message)` for this machine (see the module docstring); `run` runs nvidia-smi."""
    wants = (f"torch {TORCH} and vllm {VLLM} (constraints-gpu.txt) are CUDA {_text(CUDA)} builds: they need an NVIDIA "
             f"driver >= {MIN_DRIVER} and GPUs of compute capability >= {_text(MIN_COMPUTE_CAPABILITY)}")
    try:
        rc, out = run(QUERY)
    except FileNotFoundError:
        return 2, "gpu-smoke: no NVIDIA GPU here (no nvidia-smi): nothing to install; run it on a GPU machine"
    rows = [line.rsplit(",", 2) for line in out.splitlines() if line.count(",") >= 2]
    if (rc != 0 and "No devices were found" not in out) or (rc == 0 and not rows and out.strip()):
        return 1, (f"gpu-smoke: nvidia-smi failed (exit {rc}): {out.strip()[:500]}\n{wants}; nothing was installed")
    if not rows:
        return 2, "gpu-smoke: no NVIDIA GPU here (nvidia-smi finds no device): nothing to install"
    try:
        banner = run(["nvidia-smi"])[1]
    except FileNotFoundError:
        banner = ""
    found = re.search(r"CUDA Version:\s*(\d+\.\d+)", banner)
    cuda = version_tuple(found.group(1)) if found else None
    problems, seen = [], []
    for i, (name, driver, capability) in enumerate((part.strip() for part in row) for row in rows):
        seen.append(f"GPU {i} {name}: driver {driver}" + (f" (CUDA {_text(cuda)})" if cuda else "")
                    + f", compute capability {capability}")
        if version_tuple(driver) < version_tuple(MIN_DRIVER):
            problems.append(f"GPU {i} {name}: driver {driver} is older than {MIN_DRIVER}, the minimum of CUDA "
                            f"{_text(CUDA)}: update the NVIDIA driver")
        if version_tuple(capability) < MIN_COMPUTE_CAPABILITY:
            problems.append(f"GPU {i} {name}: compute capability {capability} is below "
                            f"{_text(MIN_COMPUTE_CAPABILITY)}, the oldest CUDA {_text(CUDA)} builds code for")
    if cuda is not None and cuda < CUDA:
        problems.append(f"the driver supports CUDA {_text(cuda)} (nvidia-smi's banner), not {_text(CUDA)}")
    if problems:
        return 1, "gpu-smoke: this machine cannot run the GPU venv: " + "; ".join(problems) + f". {wants}; " \
                  "nothing was installed"
    return 0, "gpu-smoke: " + "; ".join(seen) + f": ok for torch {TORCH} / vllm {VLLM} (CUDA {_text(CUDA)})"


def main() -> int:
    rc, message = check()
    print(message, file=sys.stderr if rc == 1 else sys.stdout, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
