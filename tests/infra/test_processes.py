"""infra.processes: finding the child that serves a port (how `posttrain run` finds Prefect's temporary API server
to lower its priority, flows/entry.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.e2e  # starts a process
def test_the_child_listening_on_a_port_is_found_and_no_other():
    from infra.processes import child_listening_on, free_port, wait_until

    port, other = free_port(), free_port()
    code = (f"import socket, time; s = socket.create_server(('127.0.0.1', {port})); print('up', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert wait_until(lambda: child_listening_on(port) == proc.pid, timeout=10)
        assert child_listening_on(other) is None
    finally:
        proc.kill()
        proc.wait()
    assert child_listening_on(port) is None
