"""A local Ray that is late to come up on a busy machine is started again, with what the failed start left stopped.

Ray waits a fixed 30 s for its raylet to register with the GCS and then raises; under load (a 2-core machine running
three test workers) that happens. `ray.init` is replaced by a stand-in that, the first time, starts a process (as
Ray's GCS and raylet are) and raises Ray's message.
"""

from __future__ import annotations

import subprocess

import psutil
import pytest

from tests.conftest import recipe

pytestmark = pytest.mark.e2e  # the stand-in starts a process


def late_then_up(calls: list, late: int):
    def init(**kwargs):
        calls.append(subprocess.Popen(["sleep", "300"]))
        if len(calls) <= late:
            raise Exception("The current node timed out during startup. This could happen because some of the "  # noqa: TRY002 - what Ray raises
                            "raylet failed to startup or the GCS has become overloaded.")
    return init


@pytest.fixture
def cfg():
    from rl_core.config import load_config

    return load_config(recipe("arithmetic"), [])


def test_a_late_local_ray_is_stopped_and_started_again(cfg, monkeypatch, caplog):
    import infra.cluster.ray_connect as rc

    calls: list[subprocess.Popen] = []
    monkeypatch.setattr(rc.ray, "init", late_then_up(calls, late=1))
    rc.start_local_ray(cfg)
    assert len(calls) == 2
    assert not psutil.pid_exists(calls[0].pid)  # killed and reaped by start_local_ray
    assert psutil.Process(calls[1].pid).is_running() and calls[1].poll() is None  # the started Ray is kept
    assert "starting it again (attempt 2 of 3)" in caplog.text
    calls[1].kill()
    calls[1].wait()


def test_a_ray_late_every_time_or_failing_otherwise_raises(cfg, monkeypatch):
    import infra.cluster.ray_connect as rc

    calls: list[subprocess.Popen] = []
    monkeypatch.setattr(rc.ray, "init", late_then_up(calls, late=99))
    with pytest.raises(Exception, match="timed out during startup"):
        rc.start_local_ray(cfg)
    assert len(calls) == rc.LOCAL_START_ATTEMPTS
    assert [psutil.pid_exists(c.pid) for c in calls] == [False] * (rc.LOCAL_START_ATTEMPTS - 1) + [True]
    calls[-1].kill()
    calls[-1].wait()

    def broken(**_):
        raise ValueError("not a start-up timeout")

    monkeypatch.setattr(rc.ray, "init", broken)
    with pytest.raises(ValueError, match="not a start-up timeout"):  # no second attempt for other failures
        rc.start_local_ray(cfg)
