"""The module paths kept for one release after infra/ was grouped into rooms: a deployment registered with the pull
step `infra.deploy_steps.enter_project`, and `python -m infra.work_pools`, go on working (in process: no Prefect)."""

from __future__ import annotations

import json
import runpy
import sys

import pytest


def test_the_old_pull_step_path_is_the_deploy_step():
    from prefect.utilities.importtools import import_object

    from infra.services.deploy_steps import enter_project

    # how Prefect resolves a pull step of a stored deployment: by its dotted import path
    assert import_object("infra.deploy_steps.enter_project") is enter_project


@pytest.mark.parametrize("which", ["gpu", "process"])
def test_python_m_of_the_old_work_pools_path_prints_the_template(which, monkeypatch, capsys):
    from infra.services.prefect_api import process_pool_template
    from infra.services.work_pools import gpu_pool_template

    monkeypatch.setattr(sys, "argv", ["infra.work_pools", which])
    runpy.run_module("infra.work_pools", run_name="__main__", alter_sys=False)
    printed = json.loads(capsys.readouterr().out)
    expected = gpu_pool_template() if which == "gpu" else process_pool_template()
    assert printed == json.loads(json.dumps(expected))
    assert "command" not in printed["variables"]["properties"]
