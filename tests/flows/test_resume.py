"""Checkpoints and resume of the GRPO flow, end to end: real Prefect, real local Ray, MLflow on SQLite.

* resume policies (`rl.resume=auto|must|off`, `job.overwrite`, refused math keys, allowed cadence keys),
  first against `plan_resume` directly, then through the flow;
* a corrupted newest checkpoint is skipped, never loaded (in the policies' run);
* checkpoints mirrored to S3 (moto's server on 127.0.0.1, started and stopped here) and a resume
  restored from S3 after the local checkpoint directory is deleted, then after the whole run directory is;
* overwrite, locking and run-directory rules. The kill-and-resume runs are in test_resume_after_kill.py.

The tiny model is random-init (its arithmetic reward is always 0), so the runs here add a KL anchor
to a *different* random-init reference model and a learning-rate warmup: every step then has a
non-zero loss and gradient and a step-dependent learning rate, so weights, optimizer, scheduler and
RNG states all have to be restored exactly for the trajectories to agree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import recipe
from tests.run_helpers import (
    artifact_paths,
    assert_same_math,
    checkpoint_steps,
    mlflow_client,
    provenance,
    read_metrics,
    run_flow,
    run_state,
    save_checkpoint,
    small_config,
)


def test_plan_resume_policies(tmp_path, monkeypatch):
    from infra.checkpoints.resume import plan_resume, write_run_state
    from infra.checkpoints.store import CheckpointStore
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    cfg = small_config()
    run_dir = Path(cfg.run_dir)
    store = CheckpointStore(run_dir / "checkpoints", keep=3)

    # nothing there: auto starts at 0, must refuses naming the setting
    assert plan_resume(cfg, store).checkpoint is None and plan_resume(cfg, store).start_step == 0
    with pytest.raises(ConfigError, match=r"rl\.resume=must"):
        plan_resume(small_config("rl.resume=must"), store)

    for step in (2, 4):
        save_checkpoint(store, cfg, step)
    write_run_state(run_dir, {"mlflow_run_id": "run-abc", "config_hash": "x"})
    plan = plan_resume(small_config("rl.resume=must"), store)
    assert plan.start_step == 4 and plan.checkpoint == store.path_for(4)
    assert plan.parts["driver"] == {"step": 4} and plan.run_state["mlflow_run_id"] == "run-abc"
    assert float(plan.parts["trainer"]["w"][0, 0]) == 4.0

    # cadence / logging keys may change
    allowed = small_config("rl.max_steps=999", "rl.save_every=7", "rl.validation.every_steps=3",
                   "rl.validation.max_prompts=5", "tracking.keep_checkpoints=1", "job.task_retries=0",
                   "cluster.num_workers=2")  # the shards load onto any number of ranks
    assert plan_resume(allowed, store).start_step == 4
    # math keys may not; each changed key is named
    with pytest.raises(ConfigError) as info:
        plan_resume(small_config("rl.optimizer.lr=2e-3", "job.seed=5"), store)
    assert "rl.optimizer.lr" in str(info.value) and "job.seed" in str(info.value)
    assert "rl.max_steps" not in str(info.value)
    for key in ("rl.objective.kl_beta=0.2", "rollout.n=2", "data.train=data/arithmetic/val.jsonl",
                "model.name_or_path=artifacts/tiny-model/ref"):
        with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")):
            plan_resume(small_config(key), store)

    # the newest checkpoint corrupted: skipped, the previous one is used
    part = store.path_for(4) / "trainer.safetensors"
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    assert plan_resume(cfg, store).start_step == 2

    # run_state.json gone (e.g. a fresh machine): the MLflow run id comes from the checkpoint meta
    (run_dir / "run_state.json").unlink()
    assert plan_resume(cfg, store).run_state == {"mlflow_run_id": "run-abc"}

    # off: refuses an existing run directory naming job.overwrite; with it, deletes the directory
    with pytest.raises(ConfigError, match=r"job\.overwrite=true"):
        plan_resume(small_config("rl.resume=off"), store)
    assert store.path_for(2).is_dir()
    plan = plan_resume(small_config("rl.resume=off", "job.overwrite=true"), store)
    assert plan.checkpoint is None and plan.run_state == {} and not run_dir.exists()


def test_plan_resume_passes_over_a_checkpoint_whose_meta_json_is_100k_deep(tmp_path, monkeypatch):
    """Issue 44, finding 9: a meta.json nested 100k deep, its manifest entry fixed up to match, raised RecursionError
    out of `plan_resume`; it is a damaged checkpoint, and the run resumes from the step before it."""
    import hashlib

    from infra.checkpoints.resume import plan_resume
    from infra.checkpoints.store import MANIFEST, CheckpointStore

    monkeypatch.chdir(tmp_path)
    cfg = small_config()
    store = CheckpointStore(Path(cfg.run_dir) / "checkpoints", keep=3)
    for step in (2, 4):
        save_checkpoint(store, cfg, step)
    deep = b"[" * 100_000 + b"]" * 100_000
    (store.path_for(4) / "meta.json").write_bytes(deep)
    manifest = json.loads((store.path_for(4) / MANIFEST).read_text())
    manifest["files"]["meta.json"] = {"size": len(deep), "sha256": hashlib.sha256(deep).hexdigest()}
    (store.path_for(4) / MANIFEST).write_text(json.dumps(manifest))
    plan = plan_resume(cfg, store)
    assert plan.start_step == 2 and plan.parts["driver"] == {"step": 2}


def test_the_run_lock_never_writes_through_a_planted_link_in_a_shared_out_dir(tmp_path, monkeypatch):
    """Issue 44, finding 10: in a shared (1777) `job.out_dir` a symlink planted at `.<name>.lock` made the run lock
    truncate its target. A symlink, a hard link, a directory or another user's file there is refused naming the
    lock's path, and the target keeps its bytes; a lock of its own is created 0600 and taken again."""
    import os
    import socket

    from infra.checkpoints.resume import RunLock, RunLocked

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    cfg = small_config(f"job.out_dir={shared}")
    lock, victim = shared / ".plan.lock", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for plant, why in ((lambda: lock.symlink_to(victim), "it is a symbolic link"),
                       (lambda: os.link(victim, lock), "it has 2 hard links"),
                       (lambda: lock.mkdir(), "it is a directory")):
        plant()
        with pytest.raises(RunLocked, match=rf"^refusing the run lock {re.escape(str(lock))}: {why}; remove it"):
            RunLock(cfg).acquire()
        assert victim.read_text() == "precious\n"
        if lock.is_dir() and not lock.is_symlink():
            lock.rmdir()
        else:
            lock.unlink()

    held = RunLock(cfg).acquire()  # none there: created, this process's, owner-only
    assert lock.read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert (lock.stat().st_mode & 0o777) == 0o600 and not lock.is_symlink()
    held.release()
    RunLock(cfg).acquire().release()  # its own lock, left behind: taken again
    mine = lock.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: mine + 1)  # the same file, seen by another user
    with pytest.raises(RunLocked, match=rf"{re.escape(str(lock))}: it belongs to uid {mine}, not to this user"):
        RunLock(cfg).acquire()


# ------------------------------------------------------------------------- policies through the flow

@pytest.mark.e2e
def test_flow_resume_policies(cwd, tmp_path):
    from rl_core.config import ConfigError

    client = mlflow_client(cwd)
    run_dir = cwd / "runs" / "pol"
    first = run_flow("job.name=pol", "rl.max_steps=4", "rl.save_every=2")
    before = (run_dir / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert checkpoint_steps(run_dir) == [2, 4]
    run_id = first["mlflow_run_id"]
    assert run_state(run_dir)["mlflow_run_id"] == run_id

    # must without any checkpoint (another job.name): fails naming the setting, trains nothing
    with pytest.raises(ConfigError, match=r"rl\.resume=must"):
        run_flow("job.name=pol-none", "rl.max_steps=2", "rl.resume=must")
    assert not (cwd / "runs" / "pol-none" / "metrics.jsonl").exists()
    assert not (cwd / "runs" / "pol-none" / "checkpoints").exists()

    # a math key changed: refused naming it, the run directory untouched
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.lr") as info:
        run_flow("job.name=pol", "rl.max_steps=6", "rl.optimizer.lr=2e-3")
    assert "rl.max_steps" not in str(info.value)
    assert (run_dir / "metrics.jsonl").read_bytes() == before and checkpoint_steps(run_dir) == [2, 4]

    # off on the existing directory: refused naming job.overwrite, untouched
    with pytest.raises(ConfigError, match=r"job\.overwrite"):
        run_flow("job.name=pol", "rl.max_steps=4", "rl.save_every=2", "rl.resume=off")
    assert (run_dir / "metrics.jsonl").read_bytes() == before and checkpoint_steps(run_dir) == [2, 4]

    # cadence keys changed: continues from step 4 under the new cadence, in the same MLflow run
    second = run_flow("job.name=pol", "rl.max_steps=7", "rl.save_every=3", "rl.validation.every_steps=5")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(8))
    assert (run_dir / "metrics.jsonl").read_bytes().startswith(before)  # steps 0..4 not rewritten
    has_val = {r["step"]: "val/accuracy" in r for r in records[5:]}
    assert has_val == {5: True, 6: False, 7: True}  # every_steps=5 (and the last step), not 2
    assert checkpoint_steps(run_dir) == [4, 6, 7]  # save_every=3 from here, the end; keep_checkpoints=3
    assert second["mlflow_run_id"] == run_id and second["step"] == 7
    assert "provenance/attempt_2.json" in artifact_paths(client, run_id)
    attempt2 = provenance(client, run_id, 2, tmp_path / "prov")
    assert attempt2["resumed_from"].endswith("step_00000004")
    run = client.get_run(run_id)
    assert run.data.tags["posttrain.attempts"] == "2" and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5, 6, 7]

    # the newest checkpoint corrupted (one bit of the weights): it is skipped, never loaded; the run resumes from
    # the one before, redoes step 7 to the same values and saves it again, valid
    from infra.checkpoints.store import CheckpointError, CheckpointStore

    part = run_dir / "checkpoints" / "step_00000007" / "trainer.safetensors"
    intact = part.read_bytes()
    raw = bytearray(intact)
    raw[len(raw) // 2] ^= 0x01
    part.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="trainer.safetensors"):
        CheckpointStore(run_dir / "checkpoints").load(7)
    run_flow("job.name=pol", "rl.max_steps=7", "rl.save_every=3", "rl.validation.every_steps=5")
    attempt3 = provenance(client, run_id, 3, tmp_path / "prov3")
    assert attempt3["resumed_from"].endswith("step_00000006")  # not the corrupted step 7
    assert client.get_run(run_id).data.tags["posttrain.resumed_from"].endswith("step_00000006")
    redone = read_metrics(run_dir)
    assert [r["step"] for r in redone] == list(range(8))
    assert redone[:7] == records[:7]  # up to the checkpoint: the very same lines (timings included)
    assert redone[7]["perf/step_s"] != records[7]["perf/step_s"]  # redone ...
    assert_same_math(redone, records)  # ... to the same values
    assert checkpoint_steps(run_dir) == [4, 6, 7]
    assert part.read_bytes() == intact  # the redone step reproduces the state bit for bit

    # off + job.overwrite: the old directory is deleted, a fresh run (new MLflow run) starts at 0
    third = run_flow("job.name=pol", "rl.max_steps=2", "rl.resume=off", "job.overwrite=true")
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert checkpoint_steps(run_dir) == [2]
    assert third["mlflow_run_id"] != run_id
    assert run_state(run_dir)["mlflow_run_id"] == third["mlflow_run_id"]
    assert artifact_paths(client, third["mlflow_run_id"], "provenance") == ["provenance/attempt_1.json"]
    # the fresh run redid steps 1 and 2 of the same math
    assert_same_math(read_metrics(run_dir), records[:3])


# ------------------------------------------------------------------------------------------- S3

def remote_files(bucket: str, prefix: str) -> dict[int, set[str]]:
    import boto3

    out: dict[int, set[str]] = {}
    for obj in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        if obj["Key"].count("/") == prefix.count("/") + 1:  # run.json, next to the step directories
            continue
        if obj["Key"].startswith(f"{prefix}/final_model/"):
            continue
        step_dir, name = obj["Key"][len(prefix) + 1:].split("/")
        out.setdefault(int(step_dir.removeprefix("step_")), set()).add(name)
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_checkpoints_to_s3_and_resume_from_s3_without_the_local_ones_then_on_a_fresh_machine(cwd, bucket, tmp_path):
    """Two losses, one S3 prefix: first the local checkpoints are deleted (the S3 copies are found), then the whole
    run directory (another machine: checkpoint, metrics history and MLflow run come from S3)."""
    import boto3

    client = mlflow_client(cwd)
    run_dir = cwd / "runs" / "s3run"
    s3 = [f"tracking.checkpoint_uri=s3://{bucket}/run1", "tracking.keep_checkpoints=2", "rl.save_every=1",
          "job.name=s3run", "rl.validation.every_steps=1"]
    first = run_flow(*s3, "rl.max_steps=2")
    local = {p.name: sorted(f.name for f in p.iterdir()) for p in (run_dir / "checkpoints").iterdir()}
    assert sorted(local) == ["step_00000001", "step_00000002"]
    prefix = f"run1/s3run/{json.loads((run_dir / 'run_state.json').read_text())['run_id']}"  # per run
    remote = remote_files(bucket, prefix)
    assert sorted(remote) == [1, 2]
    for step in (1, 2):  # every local file, manifest included, is in S3
        assert remote[step] == set(local[f"step_{step:08d}"]) and "manifest.json" in remote[step]
        body = boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/step_{step:08d}/manifest.json")["Body"]
        assert json.loads(body.read())["step"] == step
    # the final model too, every file as the run directory has it
    model = {f.relative_to(run_dir / "final_model").as_posix(): f.read_bytes()
             for f in (run_dir / "final_model").rglob("*") if f.is_file()}
    assert any(name.endswith(".safetensors") for name in model)
    for name, data in model.items():
        assert boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/final_model/{name}")["Body"].read() == data
    before = read_metrics(run_dir)
    assert [r["step"] for r in before] == [0, 1, 2] and "perf/checkpoint_s" in before[2]

    shutil.rmtree(run_dir / "checkpoints")
    second = run_flow(*s3, "rl.max_steps=3", "rl.resume=must")  # must: it has to find the S3 copy
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[:3] == before  # steps up to the restored checkpoint were not redone (timings too)
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    attempt2 = provenance(client, first["mlflow_run_id"], 2, tmp_path / "prov")
    assert attempt2["resumed_from"].endswith("step_00000002")
    # keep_checkpoints=2, remotely and locally: step 1 pruned, step 3 uploaded with its manifest
    remote = remote_files(bucket, prefix)
    assert sorted(remote) == [2, 3] and "manifest.json" in remote[3]
    assert checkpoint_steps(run_dir) == [2, 3]
    assert remote[3] == {f.name for f in (run_dir / "checkpoints" / "step_00000003").iterdir()}

    shutil.rmtree(run_dir)  # a fresh machine
    third = run_flow(*s3, "rl.max_steps=4", "rl.resume=must")
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed[:3] == records[:3]  # logged before the checkpoint: restored as they were, timings too
    # step 3's line was saved with its checkpoint, before its checkpoint time and its evaluation were known: the
    # resumed run evaluated step 3 again (same weights: same val/* values, a new perf/evaluate_s)
    retimed = ("perf/checkpoint_s", "perf/evaluate_s")
    assert {k: v for k, v in resumed[3].items() if k not in retimed} == \
        {k: v for k, v in records[3].items() if k not in retimed}
    assert "val/accuracy" in resumed[3] and "perf/evaluate_s" in resumed[3]
    assert third["mlflow_run_id"] == first["mlflow_run_id"]  # from the checkpoint's meta
    assert sorted(remote_files(bucket, prefix)) == [3, 4]


@pytest.mark.e2e
@pytest.mark.slow
def test_resume_at_an_epoch_boundary_trains_the_remaining_steps(cwd):
    """A run resumed from a checkpoint at the end of an epoch trains the remaining steps (verl #5725 trained zero
    and exited cleanly). 8 train prompts, 4 per step: epochs end at steps 2, 4 and 6."""
    from safetensors.torch import load_file

    small = cwd / "train8.jsonl"
    small.write_text("".join((cwd / "data" / "arithmetic" / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    common = [f"data.train={small}", "rl.save_every=2", "rl.validation.every_steps=2"]
    run_flow(*common, "job.name=epoch-straight", "rl.max_steps=6")
    run_flow(*common, "job.name=epoch-resumed", "rl.max_steps=2")  # stops on the first epoch's last step
    result = run_flow(*common, "job.name=epoch-resumed", "rl.max_steps=6")
    assert result["step"] == 6
    straight, resumed = (read_metrics(cwd / "runs" / n) for n in ("epoch-straight", "epoch-resumed"))
    assert [r["step"] for r in resumed if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_same_math(resumed, straight)
    rows = [r["data/prompt_rows"] for r in resumed if "data/prompt_rows" in r]
    for epoch in range(3):  # every epoch, the resumed one included, visits each prompt once
        assert sorted(rows[2 * epoch] + rows[2 * epoch + 1]) == list(range(8))
    assert len({tuple(rows[2 * e] + rows[2 * e + 1]) for e in range(3)}) > 1  # and reshuffles
    a, b = (load_file(cwd / "runs" / n / "final_model" / "model.safetensors") for n in ("epoch-straight", "epoch-resumed"))
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.e2e
@pytest.mark.slow
def test_dynamic_sampling_and_the_curriculum_resume_bitwise(cwd, warm_model):
    """rollout.filter_groups and data.sampler=curriculum together, from the warm start (groups that all pass or all
    fail, and some that split): 4 steps straight; then the run resumed from its step-2 checkpoint (the later one
    gone, as after a crash) redoes steps 3 and 4 to the same values, rounds, prompts and weights, bit for bit: the
    extra rounds' seeds, the curriculum's generator and its pass-rate table all come back from the checkpoint."""
    from safetensors.torch import load_file

    from infra.checkpoints.store import CheckpointStore

    overrides = [f"model.name_or_path={warm_model[0]}", "rollout.filter_groups=true", "rollout.filter_max_rounds=2",
                 "data.sampler=curriculum", "rl.max_steps=4", "rl.save_every=2", "rl.validation.before_training=false",
                 "rl.validation.every_steps=0", "job.name=dyn"]
    run_dir = cwd / "runs" / "dyn"
    run_flow(*overrides)
    straight = read_metrics(run_dir)
    weights = load_file(run_dir / "final_model" / "model.safetensors")
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert sum(r["rollout/filter/rounds"] for r in straight) >= 1, straight  # the filter had work to do
    assert sum(r["rollout/filter/dropped_all_correct"] + r["rollout/filter/dropped_all_wrong"] for r in straight) >= 1
    for r in straight:  # every generated prompt is one of the step's rounds; the batch is prompts_per_step groups
        assert len(r["data/generated_rows"]) == r["rollout/filter/generated_prompts"] and len(r["data/prompt_rows"]) == 4
    store = CheckpointStore(run_dir / "checkpoints")
    saved = store.load(2)[0]["driver"]["sampler"]
    assert saved["kind"] == "curriculum" and 0 < saved["seen"].sum() == len({x for r in straight[:2]
                                                                              for x in r["data/generated_rows"]})

    shutil.rmtree(store.path_for(4))  # a crash after step 2's checkpoint: only it is left
    run_flow(*overrides)
    resumed = read_metrics(run_dir)
    assert resumed[:2] == straight[:2]  # restored from the checkpoint, timings too
    assert_same_math(resumed, straight)
    again = load_file(run_dir / "final_model" / "model.safetensors")
    assert all(weights[k].equal(again[k]) for k in weights)


def test_restore_metrics_fills_only_a_log_that_lacks_saved_steps(tmp_path):
    from flows.runner import restore_metrics
    from infra.tracking.tracker import MetricsLog

    saved = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "train/loss": 0.25}]
    text = "".join(MetricsLog.line(r) + "\n" for r in saved)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert restore_metrics(log, text) == [0, 1] and log.read() == saved  # no file: restored
    log.replace([{"step": 0, "val/accuracy": 0.5, "extra": 1.0}, {"step": 1, "train/loss": 0.25}])
    assert restore_metrics(log, text) == [] and log.read()[0]["extra"] == 1.0  # complete: kept as it is
    log.replace([{"step": 1, "train/loss": 0.25}])
    assert restore_metrics(log, text) == [0] and log.read() == saved  # a step missing: the saved copy wins
    assert restore_metrics(log, None) == [] and restore_metrics(log, "") == []  # an older checkpoint: nothing


# ----------------------------------------------------------------- exact resume after a real SIGKILL


@pytest.mark.e2e
def test_overwrite_does_not_leave_the_old_runs_checkpoints_in_s3(bucket, tmp_path, monkeypatch):
    from infra.checkpoints.resume import plan_resume
    from infra.checkpoints.store import CheckpointStore, checkpoint_step

    monkeypatch.chdir(tmp_path)
    remote = [f"tracking.checkpoint_uri=s3://{bucket}/run1", "tracking.keep_checkpoints=2"]
    cfg = small_config(*remote)

    def store() -> CheckpointStore:
        return CheckpointStore(Path(cfg.run_dir) / "checkpoints", keep=2, remote_uri=cfg.tracking.checkpoint_uri)

    for step in (4, 6):  # the old run got to step 6
        save_checkpoint(store(), cfg, step, run_id="old-run")
    fresh = small_config(*remote, "rl.resume=off", "job.overwrite=true")
    assert plan_resume(fresh, store()).checkpoint is None
    save_checkpoint(store(), fresh, 2, run_id="new-run")  # the new run's first checkpoint
    shutil.rmtree(Path(cfg.run_dir) / "checkpoints")  # the machine is lost; resume from S3
    restored = store().latest_valid()
    assert restored is not None and checkpoint_step(restored) == 2


def test_changed_math_key_is_refused_before_the_first_checkpoint_too(tmp_path, monkeypatch):
    from infra.checkpoints.resume import plan_resume, write_run_state
    from infra.checkpoints.store import CheckpointStore
    from rl_core.config import ConfigError, config_hash, write_resolved

    monkeypatch.chdir(tmp_path)
    cfg = small_config()
    run_dir = Path(cfg.run_dir)
    write_resolved(cfg, run_dir)  # what a run killed at step 1 leaves: no checkpoint yet
    write_run_state(run_dir, {"mlflow_run_id": "run-abc", "config_hash": config_hash(cfg)})
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    changed = small_config("rl.optimizer.lr=2e-3")
    with pytest.raises(ConfigError, match=r"rl\.optimizer\.lr"):
        plan_resume(changed, CheckpointStore(Path(changed.run_dir) / "checkpoints"))


def test_overwrite_deletes_only_a_recognisable_run_directory(tmp_path, monkeypatch):
    """job.overwrite=true with a job.out_dir/job.name that points at other data refuses and deletes nothing."""
    from infra.checkpoints.resume import plan_resume
    from infra.checkpoints.store import CheckpointStore
    from rl_core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    precious = tmp_path / "home"
    (precious / "thesis").mkdir(parents=True)
    (precious / "thesis" / "draft.tex").write_text("years of work")
    (tmp_path / "afile").write_text("not a directory")
    for out_dir, name in ((str(tmp_path), "home"), (str(tmp_path), "afile")):
        cfg = small_config("rl.resume=off", "job.overwrite=true", f"job.out_dir={out_dir}", f"job.name={name}")
        store = CheckpointStore(tmp_path / name / "checkpoints", keep=3)
        with pytest.raises(ConfigError, match="not a posttrain run directory"):
            plan_resume(cfg, store)
    assert (precious / "thesis" / "draft.tex").read_text() == "years of work"
    assert (tmp_path / "afile").read_text() == "not a directory"
    # a real run directory with a stray user file in it: also refused, named
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "my_notes.txt").write_text("keep")
    cfg = small_config("rl.resume=off", "job.overwrite=true", f"job.out_dir={tmp_path / 'runs'}", "job.name=r")
    with pytest.raises(ConfigError, match="my_notes.txt"):
        plan_resume(cfg, CheckpointStore(run / "checkpoints", keep=3))
    (run / "my_notes.txt").unlink()
    plan_resume(cfg, CheckpointStore(run / "checkpoints", keep=3))  # now a plain run: deleted
    assert not run.exists()


def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path):
    """A crash mid-append leaves a last line without its newline: it is skipped (its step is redone);
    a bad line in the middle is an error naming the file and line."""
    from infra.tracking.tracker import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    log = MetricsLog(path)
    assert [r["step"] for r in log.read()] == [1, 2]
    log.truncate_after(2)  # what a resume does: the torn line is gone, the file is whole again
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n'
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        MetricsLog(path).read()


@pytest.mark.e2e
def test_bad_data_fails_before_an_overwrite_deletes_the_previous_run(cwd, tmp_path):
    """rl.resume=off job.overwrite=true with an empty train file: the flow fails naming data.train, and the run
    directory it would have replaced (checkpoints, metrics) is untouched."""
    from rl_core.config import ConfigError

    run_dir = cwd / "runs" / "keep"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"data\.train=.*no examples"):
        run_flow("job.name=keep", "rl.resume=off", "job.overwrite=true", f"data.train={empty}")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (run_dir / "checkpoints" / "step_00000002" / "manifest.json").is_file()


@pytest.mark.e2e
def test_runs_sharing_a_checkpoint_uri_keep_their_checkpoints_apart(bucket, tmp_path, monkeypatch):
    """Two jobs with one tracking.checkpoint_uri: each lists, loads and prunes only its own steps."""
    from infra.checkpoints.resume import checkpoint_prefix, plan_resume
    from infra.checkpoints.store import CheckpointStore, checkpoint_step

    monkeypatch.chdir(tmp_path)
    shared = [f"tracking.checkpoint_uri=s3://{bucket}/team", "tracking.keep_checkpoints=1"]
    a, b = small_config(*shared, "job.name=alpha"), small_config(*shared, "job.name=beta")
    assert checkpoint_prefix(a, "0123456789abcdef") == f"s3://{bucket}/team/alpha/0123456789abcdef"

    def store(cfg) -> CheckpointStore:
        return CheckpointStore(Path(cfg.run_dir) / "checkpoints", keep=1,
                               remote_uri=checkpoint_prefix(cfg, "0123456789abcdef"))

    save_checkpoint(store(a), a, 7, run_id="alpha-run")
    save_checkpoint(store(b), b, 3, run_id="beta-run")  # keep_checkpoints=1 prunes only beta's older steps
    for cfg in (a, b):
        shutil.rmtree(Path(cfg.run_dir) / "checkpoints")  # machines lost: resume from S3
    assert checkpoint_step(store(a).latest_valid()) == 7
    assert checkpoint_step(store(b).latest_valid()) == 3
    assert plan_resume(b, store(b)).run_state == {"mlflow_run_id": "beta-run"}


@pytest.mark.e2e
def test_two_runs_of_one_job_name_in_two_directories_never_prune_or_resume_each_other(bucket, tmp_path, monkeypatch):
    """The audit's collision: one job.name and one tracking.checkpoint_uri, two job.out_dirs, both running (their
    run locks are per directory). Each run's steps live under its own run id: the second's pruning (keep=2) leaves
    the first's steps, and the first, after losing its disk, resumes from its own newest step, not the other's."""
    from flows.runner import TrainingRun
    from infra.checkpoints.store import checkpoint_step

    monkeypatch.chdir(tmp_path)
    shared = [f"tracking.checkpoint_uri=s3://{bucket}/team", "tracking.keep_checkpoints=2", "job.name=same"]
    a, b = (small_config(*shared, f"job.out_dir={tmp_path / d}") for d in ("a", "b"))

    def save(run, cfg, steps, mlflow_run_id):
        for step in steps:
            save_checkpoint(run.store, cfg, step, run_id=mlflow_run_id)
            run.store.flush()

    with TrainingRun.prepare(a, recipe("arithmetic"), [], print) as run_a, \
            TrainingRun.prepare(b, recipe("arithmetic"), [], print) as run_b:
        assert run_a.store.remote_uri != run_b.store.remote_uri
        save(run_a, a, (100, 200), "mlflow-a")
        save(run_b, b, (300, 400, 500), "mlflow-b")
        assert run_a.store.list_remote() == [100, 200] and run_b.store.list_remote() == [400, 500]
        first_prefix = run_a.store.remote_uri
    shutil.rmtree(tmp_path / "a")  # the first run's disk is lost: it resumes from S3
    with TrainingRun.prepare(a, recipe("arithmetic"), [], print) as again:
        assert again.store.remote_uri == first_prefix
        assert checkpoint_step(again.plan.checkpoint) == 200 and again.plan.run_state == {"mlflow_run_id": "mlflow-a"}
    # an endpoint that lost run.json (moto restarted empty, then the uploads caught up): the newest checkpoint's
    # meta.json names the run directory too
    import boto3

    boto3.client("s3").delete_object(Bucket=bucket, Key=f"{first_prefix.removeprefix(f's3://{bucket}/')}/run.json")
    shutil.rmtree(tmp_path / "a")
    with TrainingRun.prepare(a, recipe("arithmetic"), [], print) as again:
        assert again.store.remote_uri == first_prefix and checkpoint_step(again.plan.checkpoint) == 200


@pytest.mark.e2e
def test_one_s3_prefix_has_one_writer_leased_renewed_released_and_taken_over_when_stale(bucket, tmp_path, monkeypatch):
    """The audit's collision across hosts: another host with the same checkout path recorded its run on S3 (run.json
    names this very run directory) and holds it. A run here with no run_state.json adopts that run id, and is
    refused by the prefix's lease, naming the holder, before anything of it is written there. A stale lease is taken
    over with a warning, renewed while the run lives and released at its end; a run whose lease another host took
    over writes nothing more there; a holder that held this machine's run lock (killed, its lock free) is taken over
    at once."""
    import logging
    import time

    import boto3

    from flows.runner import TrainingRun
    from infra.checkpoints.lease import LeaseHeld, LeaseLost
    from infra.checkpoints.resume import checkpoint_prefix
    from infra.checkpoints.store import CheckpointError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("infra.checkpoints.lease.RENEW_S", 0.2)
    s3 = boto3.client("s3")
    cfg = small_config(f"tracking.checkpoint_uri=s3://{bucket}/team", "job.name=shared")
    run_id = "00c0ffee00c0ffee"
    prefix = checkpoint_prefix(cfg, run_id).removeprefix(f"s3://{bucket}/")
    here = str(Path(cfg.run_dir).resolve())
    recorded = {"run_id": run_id, "run_dir": here, "job_name": "shared", "host": "builder-2"}

    def plant(key: str, data: dict) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=json.dumps(data).encode())

    def stored(key: str) -> dict | None:
        try:
            return json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read())
        except s3.exceptions.NoSuchKey:
            return None

    plant("run.json", recorded)
    theirs = {"owner": "f" * 32, "host": "builder-2", "pid": 4242, "run_dir": here, "since": "2026-01-01T00:00:00+00:00",
              "renewed": "2026-01-01T00:05:00+00:00", "expires": time.time() + 300}
    plant("lease.json", theirs)
    with pytest.raises(LeaseHeld, match=r"leased to another run: pid 4242 on host builder-2 \(run directory "):
        TrainingRun.prepare(cfg, recipe("arithmetic"), [], print)
    assert stored("run.json") == recorded and stored("lease.json") == theirs  # nothing of this run written there

    plant("lease.json", {**theirs, "expires": time.time() - 1})  # builder-2 died: its lease ran out
    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())  # Prefect's logging setup replaced caplog's
    logging.getLogger("posttrain.storage").addHandler(catch)
    try:
        with TrainingRun.prepare(cfg, recipe("arithmetic"), [], print) as run:
            assert run.store.remote_uri == f"s3://{bucket}/{prefix}"  # the recorded run, continued here
    finally:
        logging.getLogger("posttrain.storage").removeHandler(catch)
    assert any("taking over the lease" in w and "pid 4242 on host builder-2" in w for w in warned), warned

    with TrainingRun.prepare(cfg, recipe("arithmetic"), [], print) as run:
        mine = stored("lease.json")
        assert mine["pid"] == os.getpid() and mine["owner"] == run.store.lease.owner
        time.sleep(1.0)
        assert stored("lease.json")["expires"] > mine["expires"]  # renewed while the run lives
        s3.delete_object(Bucket=bucket, Key=f"{prefix}/lease.json")  # S3 lost it (a store restarted empty)
        deadline = time.time() + 10
        while stored("lease.json") is None and time.time() < deadline:
            time.sleep(0.1)
        assert stored("lease.json")["owner"] == run.store.lease.owner and run.store.lease.held  # written again
        save_checkpoint(run.store, cfg, 1)
        run.store.flush()
    assert stored("lease.json") is None and run.store.list_remote() == [1]  # released at the end

    with TrainingRun.prepare(cfg, recipe("arithmetic"), [], print) as run:
        plant("lease.json", {**theirs, "expires": time.time() + 300})  # it stalled; builder-2 took the prefix over
        deadline = time.time() + 10
        while run.store.lease.held and time.time() < deadline:
            time.sleep(0.1)
        with pytest.raises(LeaseLost, match="taken over by pid 4242 on host builder-2"):
            run.store.write_remote_json("run.json", recorded)
        save_checkpoint(run.store, cfg, 2)  # kept locally; its upload refused
        with pytest.raises(CheckpointError, match="LeaseLost: this run's lease .* taken over by pid 4242"):
            run.store.flush()
    assert run.store.list_remote() == [1] and stored("lease.json")["owner"] == theirs["owner"]

    # a holder killed on this machine: its lock file names its lease, and its lock is free now
    (tmp_path / "runs" / ".shared.lock").write_text(f"pid 4242 on {os.uname().nodename}\nlease {theirs['owner']}\n")
    with TrainingRun.prepare(cfg, recipe("arithmetic"), [], print) as run:
        assert stored("lease.json")["owner"] == run.store.lease.owner


@pytest.mark.e2e
def test_a_second_run_of_the_same_directory_is_refused_while_the_first_holds_it(tmp_path, monkeypatch):
    """The run lock: another process holding it (a deployment triggered twice) makes prepare fail at once,
    naming the holder, with the first run's files untouched; a kill -9 of the holder frees it."""

    from flows.runner import TrainingRun
    from infra.checkpoints.resume import RunLocked

    monkeypatch.chdir(tmp_path)
    cfg = small_config("job.name=locked")
    run_dir = Path(cfg.run_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from infra.checkpoints.resume import RunLock; from rl_core.config import load_config; "
         "cfg = load_config(sys.argv[2], ['job.name=locked']); lock = RunLock(cfg).acquire(); print('held', flush=True); "
         "time.sleep(120)"), str(Path(__file__).resolve().parents[2]), recipe("arithmetic")],
        cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for mode in ("auto", "off"):
            with pytest.raises(RunLocked, match=rf"in use by pid {holder.pid} "):
                TrainingRun.prepare(small_config("job.name=locked", f"rl.resume={mode}", "job.overwrite=true"), "r", [],
                                    announce=print)
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the OS released the dead holder's lock, and this process now holds it
    with TrainingRun.prepare(cfg, "r", [], announce=print) as run, pytest.raises(RunLocked):
        TrainingRun.prepare(cfg, "r", [], announce=print)
    with TrainingRun.prepare(cfg, "r", [], announce=print):  # released by the context exit
        pass
    assert run.lock is not None


# ------------------------------------------------------------------------------ faults survived
