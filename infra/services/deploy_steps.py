"""Prefect pull steps of posttrain's deployments (referenced by import path in prefect.yaml).

`enter_project` changes into the posttrain checkout the flow run should use. It works with plain
`prefect deploy --all` and any process worker, with or without `POSTTRAIN_PROJECT_DIR`: the
directory recorded at deploy time when it was set, else `POSTTRAIN_PROJECT_DIR` of the run's
environment, else the checkout this package is installed from (`pip install -e .`). Prefect's own
`set_working_directory` with an unset variable received `''` and crashed the run with
`FileNotFoundError: ''`.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_DIR_ENV = "POSTTRAIN_PROJECT_DIR"
INSTALLED_CHECKOUT = Path(__file__).resolve().parents[2]


def project_directory(directory: str | None = None) -> Path:
    """The checkout a flow run uses (see the module docstring); a clear error when it is not one."""
    chosen = (directory or "").strip()
    if not chosen or chosen.startswith("{{"):  # an unresolved placeholder counts as unset
        chosen = os.environ.get(PROJECT_DIR_ENV, "").strip() or str(INSTALLED_CHECKOUT)
    path = Path(chosen).expanduser().resolve()
    if not (path / "prefect.yaml").is_file() or not (path / "flows").is_dir():
        raise RuntimeError(f"{path} is not a posttrain checkout (no prefect.yaml and flows/); set {PROJECT_DIR_ENV} "
                           "to the checkout's absolute path in the worker's environment, or redeploy from it")
    return path


def enter_project(directory: str | None = None) -> dict[str, str]:
    """Pull step: chdir into the checkout; returns `{"directory": path}` for later steps."""
    path = project_directory(directory)
    os.chdir(path)
    return {"directory": str(path)}
