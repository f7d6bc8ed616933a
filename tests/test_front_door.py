"""The README's first command as a newcomer runs it: `make demo` in a copy of the checkout's files (no data, runs or
MLflow store), from its root, through the installed `posttrain` console script, with nothing on PYTHONPATH and no
pytest on the path: every recipe validates (`examples.own_data`'s rewards included) and the arithmetic quickstart
builds its data and tiny model and runs, shortened to a few steps (`DEMO_OVERRIDES`).

The warm start is the session's (`warm_model`: params.yaml's build, the bytes `make demo` would build, in minutes of
CPU); building it from the console script in a fresh clone is `tests/flows/test_dvc.py`'s `dvc repro`.

Under pytest the checkout is on `sys.path`, so an import path that works in the other tests can still fail from
the console script; this test is the one that would see it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 2
# completions logged at both steps: the second appends to the MLflow table (a download, whose bar must not show)
SHORT_QUICKSTART = (f"rl.max_steps={STEPS} rl.validation.max_prompts=50 rl.save_every=0 "
                    "tracking.sample_completions_every=1")


def checkout_files(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked, plus new ones git does not ignore), times kept (so
    `make` finds the venv up to date), copied to `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a file deleted in the work tree is still listed until committed
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def demo(tmp_path_factory, warm_model):
    root = checkout_files(tmp_path_factory.mktemp("fresh-checkout"))
    shutil.copytree(warm_model[0], root / "artifacts" / "tiny-model" / "warm")
    venv = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "VIRTUAL_ENV")}
    out = subprocess.run(["make", "demo", f"VENV={venv}", "-o", f"{venv}/.posttrain-installed",
                          f"DEMO_OVERRIDES={SHORT_QUICKSTART}"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1200, check=False)
    return root, out


def test_make_demo_validates_every_recipe_and_runs_the_quickstart(demo):
    root, out = demo
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "every recipe validates" in out.stdout
    for built in ("data/arithmetic/train.jsonl", "artifacts/tiny-model/init/config.json",
                  "artifacts/tiny-model/warm/model.safetensors", "mlflow.db"):
        assert (root / built).is_file(), built
    records = [json.loads(line) for line in (root / "runs/arithmetic/metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == STEPS
    # the demo's last line: the warm start's held-out accuracy before training, read back by `summarize`
    assert f"summarize: {STEPS} steps, held-out val/accuracy" in out.stdout
    assert json.loads((root / "runs/arithmetic/summary.json").read_text())["steps"] == STEPS
    assert "Downloading artifacts" not in out.stdout + out.stderr  # only the run's own progress display draws


def test_user_code_imports_from_the_console_script_outside_the_checkout(tmp_path):
    """From a directory that is not the checkout, with nothing on PYTHONPATH: `examples.own_data` (the rewards of
    recipes/own_data_lora.py) imports as part of the installed package, and a module of the user's beside them in
    the working directory imports as `python -m` would find it."""
    (tmp_path / "my_rewards.py").write_text("def exact(completions, answer, **_):\n"
                                            "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rewards = "data.rewards=[{path: 'examples.own_data:answer_digits', weight: 0.5}, {path: 'my_rewards:exact', weight: 0.5}]"
    out = subprocess.run([str(Path(sys.prefix) / "bin" / "posttrain"), "validate", "--no-env",
                          str(REPO / "recipes" / "own_data_lora.py"), "--", rewards],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "my_rewards:exact" in out.stdout  # the resolved config holds the user's function
