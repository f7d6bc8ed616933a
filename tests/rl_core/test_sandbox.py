"""The sandbox (rl_core.agents.sandbox, docs/security.md "Sandboxes"): code run in it cannot read the host's
variables or files, write outside its directory, reach the network, fork without bound, exhaust memory or disk, or
outlive its run; each attempt is an error the model reads, and the next call works."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from ast import literal_eval
from pathlib import Path

import pytest

from rl_core.agents.sandbox import (
    ContainerSandbox,
    Limits,
    LocalSandbox,
    SandboxError,
    container_runtime,
    local_sandbox_problem,
    python_tool,
)
from rl_core.agents.sandbox.local import _binds
from rl_core.agents.tools import tool_schema

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e  # every test starts a jail: a process


def code(text: str) -> str:
    return textwrap.dedent(text).strip()


@pytest.fixture()
def sandbox():
    with LocalSandbox(Limits(seconds=5, memory_bytes=256 << 20, processes=16, file_bytes=1 << 20,
                             disk_bytes=4 << 20)) as box:
        yield box


def still_works(box) -> None:
    assert box.run_python("print(6 * 7)").stdout == "42\n"


def test_this_machine_runs_the_local_sandbox():
    assert local_sandbox_problem() is None


def test_the_python_tool_answers_with_what_the_code_printed_and_with_its_errors(sandbox):
    tool = python_tool(sandbox)
    assert tool_schema(tool)["function"]["name"] == "python"
    assert tool_schema(tool)["function"]["parameters"]["required"] == ["code"]
    assert tool("print(123 + 456 + 789)") == "1368"
    answer = tool("print('partial')\n1 / 0")
    assert answer.startswith("partial\n") and "ZeroDivisionError" in answer and answer.endswith("error: exit code 1")
    assert tool("x = 1") == "(no output)"
    answer = tool("print('y' * 100000)")  # the output is cut at Limits.output_bytes, the rest counted
    assert answer.startswith("y" * 100) and f"[{100001 - (16 << 10)} more bytes of output cut]" in answer
    still_works(sandbox)


def test_files_are_read_and_written_inside_the_episodes_directory_only(sandbox, tmp_path):
    sandbox.write("data/in.bin", bytes(range(256)) * 4)
    assert sandbox.read("data/in.bin") == bytes(range(256)) * 4
    assert sandbox.run_python("print(open('data/in.bin', 'rb').read()[:3])").stdout == "b'\\x00\\x01\\x02'\n"
    assert sandbox.run(["pwd"]).stdout == "/sandbox\n"
    for outside in ("../escape", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(SandboxError, match="relative|outside"):
            sandbox.read(outside)
        with pytest.raises(SandboxError, match="relative|outside"):
            sandbox.write(outside, b"x")
    # a link the code plants is followed as the sandbox's user, inside its jail: nothing the host could read leaks
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    sandbox.run(["ln", "-s", str(secret), "planted"])
    sandbox.run(["ln", "-s", "/etc/shadow", "shadow"])
    for link in ("planted", "shadow"):
        with pytest.raises(SandboxError, match="cannot read"):
            sandbox.read(link)
    with pytest.raises(SandboxError, match="over Limits.file_bytes"):
        sandbox.write("big", b"x" * ((1 << 20) + 1))
    still_works(sandbox)


def test_the_hosts_variables_processes_and_files_are_out_of_reach(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cr3t-value")
    credentials = tmp_path / ".aws" / "credentials"
    credentials.parent.mkdir()
    credentials.write_text("[default]\naws_secret_access_key = s3cr3t-value\n")
    result = sandbox.run_python(code(f"""
        import os
        print(sorted(os.environ))
        print([p for p in os.listdir('/proc') if p.isdigit()])
        for path in ({str(credentials)!r}, {str(REPO / 'README.md')!r}):
            print(path, os.path.exists(path))
        home = {os.path.expanduser('~')!r}
        print(sorted(os.listdir(home)) if os.path.isdir(home) else [])
        for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
            try:
                print(pid, open(f'/proc/{{pid}}/environ', 'rb').read())
            except OSError as exc:
                print(pid, type(exc).__name__)
        print(sorted(os.listdir('/')))
    """))
    assert result.ok, result.text()
    assert "s3cr3t" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == str(["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH",
                            "PYTHONDONTWRITEBYTECODE", "TMPDIR"])
    pids = literal_eval(lines[1])  # the list the sandbox printed
    assert "1" in pids and len(pids) <= 3  # the jail's first process and the code itself: no host process
    assert lines[2:4] == [f"{credentials} False", f"{REPO / 'README.md'} False"]
    # the home folder holds at most the way to Python, where Python lives under it (pyenv, conda): none of its files
    home = Path.home()
    python = {Path(b).relative_to(home).parts[0] for b in _binds() if Path(b).is_relative_to(home)}
    assert set(literal_eval(lines[4])) == python
    # the root holds the jail's own folders and the first folder of each it shows read-only, nothing else
    shown = {Path(b).parts[1] for b in _binds()}
    assert set(literal_eval(lines[-1])) == shown | {"sandbox", "proc", "dev"} and "usr" in shown
    still_works(sandbox)


def test_code_cannot_write_outside_its_directory(sandbox, tmp_path):
    targets = [tmp_path / "planted", Path(sys.prefix) / "planted", Path("/usr/planted"), Path("/etc/planted"),
               Path("/tmp/posttrain-planted"), Path("/planted")]
    result = sandbox.run_python(code(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, 'w').write('x')
                print('wrote', path)
            except OSError as exc:
                print('refused', type(exc).__name__)
    """))
    assert result.stdout.count("refused") == len(targets), result.text()
    assert not any(t.exists() for t in targets)
    still_works(sandbox)


def test_the_network_is_removed(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        result = sandbox.run_python(code(f"""
            import socket
            for address in (('127.0.0.1', {port}), ('1.1.1.1', 53)):
                try:
                    socket.create_connection(address, timeout=2)
                    print('connected', address)
                except OSError as exc:
                    print('refused', exc.errno)
        """))
        assert result.stdout.count("refused") == 2, result.text()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()
    still_works(sandbox)


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_running(sandbox):
    result = sandbox.run_python(code("""
        import os, time
        made = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                made += 1
        except OSError as exc:
            print('stopped after', made, exc.errno)
    """))
    made = int(result.stdout.split()[2])
    assert result.stdout.startswith("stopped after") and made < 16, result.text()
    assert int(result.stdout.split()[3]) == 11  # EAGAIN: the process limit
    left = sandbox.run_python("import os; print([p for p in os.listdir('/proc') if p.isdigit()])")
    assert len(literal_eval(left.stdout)) <= 3, left.stdout  # the jail and this run: the sleepers are gone


def test_memory_and_disk_are_bounded(sandbox):
    result = sandbox.run_python("b = bytearray(512 << 20)")
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    result = sandbox.run_python(code("""
        import errno
        try:
            open('one', 'wb').write(b'x' * (2 << 20))
        except OSError as exc:
            print('file', errno.errorcode[exc.errno])
        try:
            for i in range(8):
                open(f'part{i}', 'wb').write(b'x' * (1 << 20))
        except OSError as exc:
            print('disk', errno.errorcode[exc.errno], i)
    """))
    assert "file EFBIG" in result.stdout and "disk ENOSPC" in result.stdout, result.text()
    assert int(result.stdout.split()[-1]) <= 4  # 4 MiB of directory
    still_works(sandbox)


def test_nothing_outlives_its_run_or_its_time_limit(sandbox):
    result = sandbox.run_python(code("""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, '-c',
                          'import time\\nwhile True:\\n open("beat", "a").write("x"); time.sleep(0.05)'],
                         start_new_session=True)
        while not os.path.exists('beat'):
            time.sleep(0.01)
        print('started')
    """))
    assert result.ok and result.stdout == "started\n"
    size = len(sandbox.read("beat"))
    time.sleep(0.5)
    assert size > 0 and len(sandbox.read("beat")) == size  # the process it left beating was killed with the run
    began = time.monotonic()
    result = sandbox.run_python("import time; time.sleep(60)", seconds=1)
    assert result.timed_out and result.exit_code is None and time.monotonic() - began < 10
    assert "error: the run was stopped at its time limit" in result.text()
    still_works(sandbox)
    with LocalSandbox(Limits(seconds=1)) as box:  # CPU time: the kernel stops it at 1 s whatever the wall limit
        result = box.run_python("while True: pass", seconds=30)
        assert result.exit_code == -24 and "error: the run was stopped at its CPU time limit" in result.text()
        still_works(box)


def test_a_host_process_with_a_private_umask_starts_a_working_sandbox():
    before = os.umask(0o077)  # as the flows run: files of their own are private
    try:
        with LocalSandbox() as box:
            still_works(box)
    finally:
        os.umask(before)


def test_stop_ends_the_jail_and_leaves_no_mount_point(tmp_path):
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()  # a process that died without stopping its sandbox left its empty mount point
    stale = Path(tempfile.mkdtemp(prefix=f"posttrain-sandbox-{dead.pid}-"))
    box = LocalSandbox().start()
    assert not stale.exists()
    proc, root = box._proc, box._finalizer.peek()[2][1]
    box.run(["true"])
    box.stop()
    box.stop()
    assert proc.poll() is not None and not os.path.exists(root)
    with pytest.raises(SandboxError, match="not started"):
        box.run(["true"])


def test_the_code_example_runs_its_calls_in_a_sandbox_closed_with_the_episode():
    from examples.code_arithmetic import CodeArithmetic, call_text
    from rl_core.agents.environment import Turn
    from rl_core.agents.host import LocalEnvironments
    from rl_core.tasks import Example

    host = LocalEnvironments()
    [opening] = host.open(CodeArithmetic, [("k", Example(prompt="123+456+789", answer="1368"))])
    assert opening.error is None and opening.tools[0]["function"]["name"] == "python"
    box = host.live["k"].sandbox
    [answer] = host.respond([("k", Turn.parse(call_text("123+456+789")))])
    assert answer.reply.messages == [{"role": "tool", "name": "python", "content": "1368"}]
    host.respond([("k", Turn.parse("1368"))])
    [end] = host.finish(["k"])
    assert end.reward == 1.0 and end.tool_calls == 1 and end.tool_errors == 0
    assert box._proc is None  # closed with the episode


@pytest.mark.skipif(container_runtime() is None, reason="no container runtime (docker or podman daemon) runs here")
def test_the_container_sandbox_runs_code_without_network_or_host_variables(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "s3cr3t-value")
    with ContainerSandbox(Limits(seconds=20)) as box:
        result = box.run_python("import os, socket\nprint(sorted(os.environ))\n"
                                "try:\n socket.create_connection(('1.1.1.1', 53), timeout=2)\nexcept OSError:\n"
                                " print('refused')")
        assert "s3cr3t" not in result.stdout and result.stdout.endswith("refused\n"), result.text()
        box.write("d/x.bin", b"\x00\x01")
        assert box.read("d/x.bin") == b"\x00\x01"
