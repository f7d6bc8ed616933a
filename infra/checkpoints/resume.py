"""Run directories and resume: start fresh, continue from the newest valid checkpoint, or refuse.

`rl.resume`: `auto` continues from the newest valid checkpoint (local, else the S3 copy), `must`
fails without one, `off` starts fresh and refuses an existing run directory unless
`job.overwrite=true`. A resume refuses a config that changed in any key that changes the math,
naming the keys; cadence, logging and placement keys may change.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.checkpoints.store import META, CheckpointStore, checkpoint_step, step_dir_name, write_durably
from rl_core.atomic import fsync_dir
from rl_core.config import ConfigError, PosttrainConfig, flatten
from rl_core.config.legacy import translate
from rl_core.config.loader import config_dict

# Keys that may differ between a checkpoint and the run that resumes it: when to save/evaluate/stop,
# where results go, and where the work runs. Every other key changes the math or the data.
MAY_CHANGE_ON_RESUME = (
    "rl.max_steps", "rl.save_every", "rl.resume", "rl.validation.", "tracking.", "job.task_retries",
    "job.retry_delay_s", "job.overwrite", "job.out_dir", "cluster.address", "cluster.cpus_per_worker",
    "cluster.placement", "cluster.cpus_per_engine", "cluster.gpus_per_engine", "cluster.placement_strategy",
    "cluster.placement_timeout_s", "rollout.num_engines", "rollout.gpu_memory_utilization",
    "cluster.sharding", "cluster.shard_size", "cluster.gpu_memory_gib", "cluster.host_memory_gib",  # layout and memory, not math
    "cluster.num_workers",  # the shards load onto any number of ranks (the batch split, so the rounding, differs)
    "model.gradient_checkpointing",
    "job.max_restarts", "rollout.max_logp_abs_diff",  # a guard, not math
    "data.env_workers", "data.env_timeout_s",  # where the environments run and how long they may take
)
RUN_STATE = "run_state.json"


@dataclass
class ResumePlan:
    checkpoint: Path | None
    run_state: dict[str, Any]
    parts: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def start_step(self) -> int:
        return checkpoint_step(self.checkpoint) if self.checkpoint else 0


def math_changes(saved: dict, cfg: PosttrainConfig) -> list[str]:
    """Dotted keys whose value differs from the checkpoint's config and may not change on resume. A key the saved
    config lacks (added to the schema since) compares as its default, the value the run had without it."""
    now = flatten(cfg)
    before = _flatten_dict(translate(saved))  # a config saved in the flat shape compares in the current one
    before = {**{k: v for k, v in flatten(PosttrainConfig()).items() if k in now and k not in before}, **before}
    keys = sorted(set(now) | set(before))
    return [k for k in keys if now.get(k) != before.get(k) and not k.startswith(MAY_CHANGE_ON_RESUME)]


def _flatten_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _refuse_math_changes(saved: dict, cfg: PosttrainConfig, source: str) -> None:
    if not saved:
        return
    changed = math_changes(saved, cfg)
    if changed:
        raise ConfigError([f"resume from {source}: {key} changed since the run started (it changes the math or the "
                           "data); restore it, or start a new run (another job.name, or rl.resume=off)"
                           for key in changed])


RUN_RECORD = "run.json"  # at the top of a run's checkpoint prefix: the run id and the run directory that owns it
RUN_ID = re.compile(r"^[0-9a-f]{16}$")


def checkpoint_prefix(cfg: PosttrainConfig, run_id: str) -> str | None:
    """Where this run's checkpoints go remotely: `<tracking.checkpoint_uri>/<job.name>/<run_id>` (None: local only).

    Per run, so runs that share a `checkpoint_uri` (another job, or the same `job.name` in another directory)
    never list, load, overwrite or prune each other's steps.
    """
    uri = cfg.tracking.checkpoint_uri
    return f"{uri.rstrip('/')}/{cfg.job.name}/{run_id}" if uri else None


def run_identity(cfg: PosttrainConfig) -> str:
    """This run directory's id: the one in its `run_state.json`; with no run directory (a lost disk, another
    machine) the id recorded on S3 for this same directory (`run.json`); else a new one."""
    run_dir = Path(cfg.run_dir)
    local = read_run_state(run_dir).get("run_id")
    if isinstance(local, str) and RUN_ID.match(local):
        return local
    uri = cfg.tracking.checkpoint_uri
    if uri:
        job = CheckpointStore(run_dir / "checkpoints", remote_uri=f"{uri.rstrip('/')}/{cfg.job.name}",
                              s3_config=cfg.tracking.s3)
        here = str(run_dir.resolve())
        mine = sorted(rid for rid in job.remote_children() if RUN_ID.match(rid) and _recorded_run_dir(job, rid) == here)
        if len(mine) > 1:
            raise ConfigError([(f"{len(mine)} runs recorded for run directory {here} under {uri}/{cfg.job.name}/: "
                               f"{', '.join(mine)}; write the one to continue as {{\"run_id\": \"<id>\"}} to "
                               f"{run_dir / RUN_STATE}, or pick another job.name")])
        if mine:
            return mine[0]
    return uuid.uuid4().hex[:16]


def _recorded_run_dir(job: CheckpointStore, run_id: str) -> str | None:
    """The run directory recorded for `run_id`: its `run.json`, else (an endpoint that lost it) the meta.json of its
    newest checkpoint, which every upload carries."""
    record = job.read_remote_json(f"{run_id}/{RUN_RECORD}")
    if record is None:
        steps = CheckpointStore(job.root, remote_uri=f"{job.remote_uri}/{run_id}", s3_config=job.s3_config).list_remote()
        record = job.read_remote_json(f"{run_id}/{step_dir_name(steps[-1])}/{META}") if steps else None
    return (record or {}).get("run_dir")


def record_run(cfg: PosttrainConfig, store: CheckpointStore, run_id: str) -> None:
    """Keep the run id with the run: in `run_state.json`, and on S3 next to its checkpoints (`run.json`)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # configs, metrics, checkpoints: the owner's only
    state = read_run_state(run_dir)
    if state.get("run_id") != run_id:
        write_run_state(run_dir, {**state, "run_id": run_id})
    if store.bucket is not None:
        store.write_remote_json(RUN_RECORD, {"run_id": run_id, "run_dir": str(run_dir.resolve()),
                                             "job_name": cfg.job.name, "host": socket.gethostname()})


class RunLocked(RuntimeError):
    """Another process is running (or setting up) a run of the same directory, or its lock file is one this process
    must not write (a symbolic link, a hard link, not a regular file, another user's)."""


class RunLock:
    """An exclusive lock on one run directory, held for the whole run (`fcntl.flock` on `<out_dir>/.<name>.lock`).

    The lock file sits next to the run directory, not in it, so `job.overwrite` can delete the directory
    while holding it. The OS releases it when the process ends, however it ends (a `kill -9` included),
    so a crashed run never leaves a stale lock. A second run of the same name (a deployment triggered
    twice) fails at once, naming the holder, instead of deleting the first one's in-progress checkpoint
    and interleaving its metrics.
    """

    def __init__(self, cfg: PosttrainConfig):
        self.path = Path(cfg.job.out_dir) / f".{cfg.job.name}.lock"
        self._fh = None
        self.previous = ""  # what the lock file said before this process took it (a dead holder's S3 lease, say)

    def acquire(self) -> RunLock:
        import errno
        import fcntl
        import os
        import socket
        import stat

        self.path.parent.mkdir(parents=True, exist_ok=True)
        # `job.out_dir` may be shared (mode 1777): a symlink or hard link planted at the lock's name must not make
        # this process write through it. No following, no truncation on open, and only a plain file of one link
        # that this user owns.
        refuse = (f"refusing the run lock {self.path}: {{}}; remove it (it is not one posttrain made) or pick another "
                  "job.out_dir/job.name")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise RunLocked(refuse.format("it is a symbolic link" if exc.errno == errno.ELOOP
                                              else "it is a directory")) from None
            raise
        info = os.fstat(fd)
        why = ("it is not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"it has {info.st_nlink} hard links" if info.st_nlink != 1
               else f"it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
               if info.st_uid != os.geteuid() else None)
        if why:
            os.close(fd)
            raise RunLocked(refuse.format(why))
        fh = os.fdopen(fd, "r+")  # held open for the run's lifetime
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = (fh.read().strip().splitlines() or ["another process"])[0]  # its first line: pid and host
            fh.close()
            raise RunLocked(f"run directory {self.path.parent / self.path.name[1:-5]} is in use by {holder} "
                            f"(lock {self.path}); wait for it to finish, or pick another job.name") from None
        fh.seek(0)
        self.previous = fh.read(4096)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        return self

    def note(self, text: str) -> None:
        """Add a line to the held lock file (the S3 lease this run holds: a later holder of the lock knows it is
        free, `infra.checkpoints.lease.S3Lease.acquire`)."""
        if self._fh is not None:
            self._fh.write(text.rstrip("\n") + "\n")
            self._fh.flush()

    def release(self) -> None:
        if self._fh is not None:
            import fcntl

            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def read_run_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_run_state(run_dir: Path, state: dict[str, Any]) -> None:
    path = run_dir / RUN_STATE
    tmp = path.with_suffix(".json.tmp")
    write_durably(tmp, json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(path)
    fsync_dir(run_dir)


# What a run directory holds (flows/runner.py): `job.overwrite` deletes a directory only when it has one of
# these and nothing that is not one of them, so a mistyped job.out_dir/job.name never deletes other data.
RUN_ENTRIES = ("config_resolved.yaml", "metrics.jsonl", "metrics.jsonl.tmp", RUN_STATE, RUN_STATE + ".tmp",
               "placement.json", "checkpoints", "cache", "final_model", "export", "curve.png", "curve.json", "summary.json",
               "model", "plots", "provenance", ".lock")
RUN_MARKERS = ("config_resolved.yaml", "metrics.jsonl", RUN_STATE, "checkpoints")


def _not_a_run(run_dir: Path) -> str | None:
    """Why `run_dir` is not recognisably a posttrain run directory (None when it is)."""
    if run_dir.is_symlink() or not run_dir.is_dir():
        return "it is not a plain directory"
    names = {p.name for p in run_dir.iterdir()}
    if not names & set(RUN_MARKERS):
        return f"it holds none of {', '.join(RUN_MARKERS)}"
    foreign = sorted(n for n in names if n not in RUN_ENTRIES and not n.startswith((".tmp-", "step_")))
    if foreign:
        return f"it also holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which a run does not write"
    return None


def plan_resume(cfg: PosttrainConfig, store: CheckpointStore) -> ResumePlan:
    """Decide where this run starts; raises ConfigError naming what to do when it may not."""
    run_dir = Path(cfg.run_dir)
    mode = cfg.rl.resume
    if mode == "off":
        remote = store.list_remote()
        occupied = run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))
        if occupied or remote:
            where = str(run_dir) + (f" and {len(remote)} checkpoint(s) at {store.remote_uri}" if remote else "")
            if not cfg.job.overwrite:
                raise ConfigError([(f"rl.resume=off: {where} already exist(s); resume it (rl.resume=auto), pick another "
                                    "job.name, or set job.overwrite=true to delete it")])
            if run_dir.exists() and (why := _not_a_run(run_dir)):
                raise ConfigError([(f"job.overwrite=true would delete {run_dir}, but it is not a posttrain run directory "
                                   f"({why}); nothing was deleted. Check job.out_dir and job.name, or move it away")])
            shutil.rmtree(run_dir, ignore_errors=True)
            store.delete_remote()  # else a later resume from S3 would continue the old run
        return ResumePlan(None, {})
    checkpoint = store.latest_valid()
    if checkpoint is None:
        if mode == "must":
            raise ConfigError([(f"rl.resume=must: no valid checkpoint under {store.root} "
                                f"(nor at {store.remote_uri!r}, under tracking.checkpoint_uri)")])
        # Killed before its first checkpoint: it restarts from step 0, in the same MLflow run, whose
        # params are the old config's — so the math may not have changed here either.
        resolved = run_dir / "config_resolved.yaml"
        if resolved.is_file():
            _refuse_math_changes(yaml.safe_load(resolved.read_text()) or {}, cfg, str(resolved))
        return ResumePlan(None, read_run_state(run_dir))
    parts, meta = store.load(checkpoint)
    _refuse_math_changes(meta.get("config", {}), cfg, str(checkpoint))
    state = read_run_state(run_dir) or {"mlflow_run_id": meta.get("mlflow_run_id")}
    return ResumePlan(checkpoint, state, parts, meta)


def checkpoint_meta(cfg: PosttrainConfig, **extra: Any) -> dict[str, Any]:
    """The config, the run directory (how a run finds its own checkpoints on S3 again) and `extra`."""
    return {"config": config_dict(cfg), "run_dir": str(Path(cfg.run_dir).resolve()), **extra}
