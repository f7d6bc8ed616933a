"""The local sandbox's jail: run as `python -I -S _jail.py CONFIG_JSON` by `rl_core.agents.sandbox.local`, standard
library only (it runs before and outside the project's imports).

It builds the episode's jail once, then serves requests, one JSON line each way on stdin/stdout:

1. Namespaces: new mount, network, PID, IPC and UTS namespaces (and a user namespace first when not started by
   root, mapping its own user to root inside). The network namespace has only a loopback device, down.
2. A new root: a small tmpfs holding read-only binds of the system folders and Python's own (`binds`), four
   devices (null, zero, random, urandom), `/sandbox` (a tmpfs of `disk_bytes`: the episode's files), `/proc`.
   It becomes `/` (pivot_root; the old root is detached), then `/` is made read-only.
3. A fork: the child is PID 1 of the new PID namespace and serves requests; the outer process waits for it.

Every request (run a command, read or write a file) runs in a child of PID 1 that first drops privileges: a user of
its own (`2_000_000_000 + PID`) when started by root, else no capabilities left; no new privileges; resource
limits on CPU time, address space, processes, file size and open files. After each request PID 1 kills every
other process of its namespace: nothing an episode starts outlives the call that started it.
"""

import base64
import ctypes
import json
import os
import resource
import select
import signal
import sys
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
ST_RELATIME = 4096
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 38, 24, 28
SECUREBITS_LOCKED_NOROOT = 0x3F  # noroot, no-setuid-fixup, keep-caps: each set and locked
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
UID_BASE = 2_000_000_000


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()), f"mount {target}")


def bind_readonly(path, target):
    mount(path, target, None, MS_BIND | MS_REC)
    # a remount keeps the flags the outer namespace locked (nosuid, nodev, noexec, atime): read them back first
    flags = os.statvfs(target).f_flag
    keep = flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    keep |= MS_RELATIME if flags & ST_RELATIME else 0
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def build(cfg):
    """Enter the namespaces and the new root; returns once `/` is the jail's."""
    os.umask(0o022)  # the folders made on the way to Python's must be open to the sandbox's user, whatever the host's
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        _check(libc.unshare(CLONE_NEWUSER), "unshare a user namespace")
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in cfg["binds"]:
        target = root + path
        if os.path.islink(path):  # /bin -> usr/bin and the like
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            bind_readonly(path, target)
    os.makedirs(root + "/dev")
    for name in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] else ""  # the sandbox's user, when it has its own
    os.makedirs(root + "/sandbox")
    mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_bytes']},mode=0700{owner}")
    os.makedirs(root + "/proc")
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"no pivot_root number known for {os.uname().machine}")
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop(cfg):
    """In a request's child: become the sandbox's user (or keep no capability), then apply the limits."""
    os.setsid()
    if cfg["uid"]:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    else:
        for cap in range(64):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    limits = cfg["limits"]
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                        ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", 256), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    # SIGXCPU at the CPU limit (the run reads as stopped there), SIGKILL a second later if it is caught
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    os.chdir("/sandbox")


def kill_the_rest():
    """Kill every process of the namespace but this one (PID 1: every other is its descendant or was reparented to
    it), and reap them all."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run(cfg, argv, timeout, stdin, cap=None):
    """Run `argv` as the sandbox's user; its exit code, output (each stream capped) and whether time ran out."""
    cap = cap or cfg["limits"]["output_bytes"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            drop(cfg)
            os.execvpe(argv[0], argv, cfg["env"])
        except BaseException as exc:  # noqa: BLE001 - reported as the command's own failure
            os.write(2, f"cannot run {argv[0]}: {exc}".encode())
        os._exit(127)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    feeder = threading.Thread(target=feed, args=(in_w, stdin), daemon=True)  # the command may never read it
    feeder.start()

    def poll():
        done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if done else None

    reply = collect(out_r, err_r, poll, time.monotonic() + timeout, cap)
    kill_the_rest()
    feeder.join()
    for fd in (out_r, err_r):
        os.close(fd)
    return reply


def feed(fd, data):
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


def collect(out_fd, err_fd, poll, deadline, cap):
    """Read a command's two streams, keeping up to `cap` bytes of each (the rest counted), until it has ended
    (`poll()`: its exit code, negative for a signal, or None while it runs) and its pipes are drained (a process it
    left running may hold them open: a quiet pipe after the end is drained), or until `deadline` (monotonic)."""
    kept = {out_fd: bytearray(), err_fd: bytearray()}
    cut = {out_fd: 0, err_fd: 0}
    reading = {out_fd, err_fd}
    code = None
    while code is None or reading:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = select.select(list(reading), [], [], min(left, 0.05))[0] if reading else []
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                reading.discard(fd)
            room = max(cap - len(kept[fd]), 0)
            kept[fd] += chunk[:room]
            cut[fd] += len(chunk) - min(len(chunk), room)
        if code is None:
            code = poll()
            if code is None and not reading:
                time.sleep(0.005)
        elif not ready:
            break
    return {"exit_code": code, "timed_out": code is None,
            "stdout": base64.b64encode(bytes(kept[out_fd])).decode(), "stdout_cut": cut[out_fd],
            "stderr": base64.b64encode(bytes(kept[err_fd])).decode(), "stderr_cut": cut[err_fd]}


def serve(cfg):
    python = cfg["python"]
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "stop":
            break
        stdin = base64.b64decode(request.get("stdin", ""))
        if op == "run":
            reply = run(cfg, request["argv"], request["timeout"], stdin)
        elif op == "read":
            script = "import sys;sys.stdout.buffer.write(open(sys.argv[1],'rb').read(int(sys.argv[2])))"
            reply = run(cfg, [python, "-I", "-S", "-c", script, request["path"], str(request["limit"])], 10, b"",
                        cap=request["limit"])
        else:  # write
            script = ("import os,sys;p=sys.argv[1];os.makedirs(os.path.dirname(p) or '.',exist_ok=True);"
                      "open(p,'wb').write(sys.stdin.buffer.read())")
            reply = run(cfg, [python, "-I", "-S", "-c", script, request["path"]], 10, stdin)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def main():
    cfg = json.loads(sys.argv[1])
    cfg["uid"] = UID_BASE + os.getpid() if os.geteuid() == 0 else 0
    try:
        build(cfg)
    except OSError as exc:
        sys.stdout.write(json.dumps({"error": str(exc)}) + "\n")
        sys.stdout.flush()
        sys.exit(1)
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status) if status else 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # a /proc the outer namespace masks cannot be mounted again: the jail runs without one
    sys.stdout.write(json.dumps({"ready": True, "proc": os.path.isdir("/proc/1")}) + "\n")
    sys.stdout.flush()
    serve(cfg)
    kill_the_rest()


if __name__ == "__main__":
    main()
