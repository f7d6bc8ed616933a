"""Checkpoint storage: atomic checkpoint directories on local disk, mirrored to S3 with boto3.

Layout of one checkpoint (`root` is e.g. `runs/<name>/checkpoints`)::

    root/step_00000040/
        __0_0.distcp, __1_0.distcp  the trainer ranks' tensor shards (infra.checkpoints.shards), one file per rank
        shards.json                 their index (JSON): dtype, global shape, which file holds which slice
        driver.safetensors          the tensors of part "driver" (flatten_state)
        driver.json                 its skeleton: everything that is not a tensor, as tagged JSON
        meta.json                   the caller's meta dict
        manifest.json               written last: format version, step, parts, size + sha256 per file

A checkpoint is written into `root/.tmp-step_...` (`begin`): the driver writes its parts (`write_parts`),
other processes may write files of their own and report their size and sha256; every file and the
directory are fsynced, the manifest comes last (`commit`), then the directory is renamed to
`step_XXXXXXXX`. `save` does all three for parts alone. A directory whose manifest is missing,
unparsable or does not match its files is never loaded. Nothing is ever unpickled: parts come from
`safetensors.torch.load_file` and JSON decoded into a fixed set of types; shards hold tensors only,
read with `torch.load(weights_only=True)`.

With `remote_uri="s3://bucket/prefix"` each completed checkpoint is uploaded to
`prefix/step_XXXXXXXX/<file>` (manifest last, multipart for large files, each with a SHA256 checksum S3
checks and stores) and verified (every object's size, and S3's checksum against the local bytes) before
older checkpoints are pruned. A failed upload raises `CheckpointUploadError`; the local checkpoint and
its predecessors stay. With `background_upload=True`
(what training runs use) the upload runs in a thread, so training continues on local checkpoints
while S3 is down, and the upload catches up when it is back; `flush()` waits for it. `upload_dir` /
`download_dir` carry a directory of any files (the final model, `<prefix>/final_model/`) the same way:
every object verified, a listing (`manifest.json`) written last and checked on download. Downloads ask
for S3's checksum (ChecksumMode), so botocore checks the bytes as they arrive; the manifest's sha256
checks every file after.

What is retried: each request, by botocore in `adaptive` mode, up to `s3_config.max_attempts` tries (the
config's `tracking.s3`; connection errors, timeouts, 5xx, throttling; long enough by default to ride
out an endpoint restart). Anything botocore does not retry (an invalid request such as a bad bucket
name, NoSuchBucket, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, missing credentials)
fails at once, naming the URI and what to fix.

Credentials come only from the environment / AWS profiles (boto3's own chain): a URI with
`user:password@` is refused, and every message and log line goes through `rl_core.redact`.

The store's S3 half is in `infra.checkpoints.remote` (checkpoints: uploads, downloads, pruning) and
`infra.checkpoints.remote_files` (directories and JSON beside them), mixins of `CheckpointStore`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch

from infra.checkpoints.format import (  # noqa: F401 - re-exported: the checkpoint API is infra.checkpoints.store's
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    META,
    PART_NAME,
    RESERVED_PARTS,
    STEP_DIR,
    TMP_PREFIX,
    CheckpointError,
    check_manifest_structure,
    checkpoint_step,
    flatten_state,
    parse_json,
    sha256_file,
    step_dir_name,
    unflatten_state,
    verify_checkpoint,
    write_durably,
    write_json,
)
from infra.checkpoints.remote import (
    CheckpointUnavailable,
    CheckpointUploadError,
    RemoteCheckpoints,
)
from infra.checkpoints.remote_files import RemoteFiles
from infra.checkpoints.s3 import S3Failure, parse_s3_uri  # noqa: F401 - re-exported
from rl_core.atomic import fsync_dir, fsync_file
from rl_core.config.schema import S3Config
from rl_core.redact import redact_message

log = logging.getLogger("posttrain.storage")
MiB = 1024 * 1024
FINAL_MODEL = "final_model"  # the final model's directory, in the run directory and under the run's remote prefix


# ----------------------------------------------------------------------------------------- store

class CheckpointStore(RemoteFiles, RemoteCheckpoints):
    """Atomic checkpoints under `root`, kept to the newest `keep`, optionally mirrored to S3.

    Args:
      root: the checkpoint directory of a run, e.g. `runs/<name>/checkpoints` (created on save).
      keep: how many checkpoints to keep, locally and remotely (>= 1).
      remote_uri: `s3://bucket/prefix`, or None for local only.
      s3_config: the retries and timeouts of the S3 client (`tracking.s3` of the config; None: its defaults).
      s3_client: a boto3 S3 client; default `infra.checkpoints.s3.s3_client(s3_config, endpoint_url)`: botocore's adaptive
        retries, `AWS_ENDPOINT_URL` honoured, credentials from the environment / AWS profiles only.
      endpoint_url: an explicit S3 endpoint (else `AWS_ENDPOINT_URL` or AWS).
      background_upload: upload from a background thread, so `save` returns once the local checkpoint is
        in place and training goes on while S3 is slow or briefly down. One upload runs at a time; a
        checkpoint still waiting when a newer one is saved is skipped (the newer one supersedes it).
        A background upload that fails for good is raised by the next `save` or by `flush()`.
      multipart_threshold / multipart_chunksize: files of at least the threshold are uploaded in
        parts of chunksize bytes (S3 requires parts of >= 5 MiB except the last).
    """

    def __init__(self, root: str | Path, *, keep: int = 3, remote_uri: str | None = None,
                 s3_config: S3Config | None = None, s3_client=None, endpoint_url: str | None = None,
                 multipart_threshold: int = 64 * MiB,
                 multipart_chunksize: int = 16 * MiB, max_concurrency: int = 4, background_upload: bool = False):
        if int(keep) < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept (keep >= 1)")
        if multipart_chunksize < 5 * MiB:
            raise ValueError(f"multipart_chunksize={multipart_chunksize}: S3 parts must be >= 5 MiB")
        self.root = Path(root)
        self.keep = int(keep)
        self.remote_uri = remote_uri
        self.bucket, self.prefix = parse_s3_uri(remote_uri) if remote_uri else (None, "")
        self._s3 = s3_client
        self.endpoint_url = endpoint_url
        self.s3_config = s3_config if s3_config is not None else S3Config()
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = int(multipart_chunksize)
        self.max_concurrency = int(max_concurrency)
        self.background_upload = bool(background_upload) and self.bucket is not None
        self._uploads = threading.Condition()
        self._pending: Path | None = None  # the newest checkpoint waiting for the uploader
        self._uploading: Path | None = None
        self._upload_error: CheckpointUploadError | None = None
        self._uploader: threading.Thread | None = None
        self._parts: dict[Path, list[str]] = {}  # per temporary directory: its parts, in the order written
        self.lease: Any = None  # the run's lease on the S3 prefix (`infra.checkpoints.lease.S3Lease`): checked before each write

    def check_lease(self) -> None:
        """Raise `infra.checkpoints.lease.LeaseLost` when the run's lease on the S3 prefix was taken over (no lease: nothing)."""
        if self.lease is not None:
            self.lease.check()

    # ------------------------------------------------------------------------------------- local

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def save(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint `step` atomically, upload it when remote, then prune to the newest `keep`.

        `parts` maps a name (letters, digits, `_.-`) to any state `flatten_state` accepts, e.g.
        `{"trainer_rank0": trainer.state_dict(), "driver": {...}}`; `meta` is a JSON-able dict.
        Returns the checkpoint directory. Raises CheckpointUploadError (local copy kept, nothing
        pruned) when the upload fails after all retries.
        """
        tmp = self.begin(step)
        try:
            self.write_parts(tmp, parts)
        except BaseException:
            self.abort(tmp)
            raise
        return self.commit(tmp, step, meta)

    def begin(self, step: int) -> Path:
        """The temporary directory of checkpoint `step`, created empty: writers (the driver's `write_parts`, the
        trainer ranks' shards) fill it, then `commit` publishes it (or `abort` deletes it). One at a time: a
        leftover temporary directory is from a crashed save and is removed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint step is a non-negative int")
        self._raise_upload_error()
        final = self.path_for(step)
        if final in (self._pending, self._uploading):  # a step rewritten while it is being uploaded
            self.flush()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp_dirs()
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def write_parts(self, tmp: Path, parts: Mapping[str, Any]) -> None:
        """Write each part (`save`) into the temporary directory `tmp` as `<name>.safetensors` + `<name>.json`."""
        if not parts:
            raise ValueError("save: parts is empty; pass at least one named state, e.g. {'trainer_rank0': ...}")
        for name in parts:
            if not isinstance(name, str) or not PART_NAME.match(name) or name in RESERVED_PARTS:
                raise ValueError(f"part name {name!r}: use letters, digits, '_', '.', '-' (not 'meta' or "
                                 f"'manifest')")
        self._parts.setdefault(tmp, []).extend(parts)
        for name, state in parts.items():
            tensors, skeleton = flatten_state(state)
            st_path = tmp / f"{name}.safetensors"
            safetensors.torch.save_file(tensors, st_path, metadata={"format": "pt"})
            fsync_file(st_path)
            write_json(tmp / f"{name}.json", {"format": FORMAT_NAME, "skeleton": skeleton})

    def commit(self, tmp: Path, step: int, meta: Mapping[str, Any] | None = None,
               written: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
        """Publish the temporary directory `tmp` as checkpoint `step`: the manifest last (the size and sha256 of every
        file; `written`: those of the files other processes wrote and hashed, checked here against the file's
        size), the rename, then the upload (when remote) and pruning. `tmp` is deleted when this fails before the
        rename. Raises CheckpointUploadError as `save`."""
        try:
            meta_json = json.loads(json.dumps(dict(meta or {})))
        except (TypeError, ValueError) as exc:
            self.abort(tmp)
            raise ValueError(f"save: meta must be JSON-serialisable ({exc}); put tensors in parts") from exc
        written = dict(written or {})
        final = self.path_for(step)
        try:
            write_json(tmp / META, meta_json)
            files: dict[str, dict] = {}
            for file in sorted(tmp.iterdir()):
                entry = written.pop(file.name, None)
                if entry is None:
                    files[file.name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
                elif entry["size"] != file.stat().st_size:
                    raise CheckpointError(f"{file} has {file.stat().st_size} bytes, but its writer reported "
                                          f"{entry['size']}; the checkpoint of step {step} is not published")
                else:
                    files[file.name] = {"size": int(entry["size"]), "sha256": str(entry["sha256"])}
            if written:
                raise CheckpointError(f"{sorted(written)[:5]} were reported written to {tmp} but are not there; "
                                      f"the checkpoint of step {step} is not published")
            parts = self._parts.pop(tmp, [])
            manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step,
                        "parts": parts, "created_unix": time.time(), "files": files}
            write_json(tmp / MANIFEST, manifest)  # last: its presence marks the checkpoint complete
            fsync_dir(tmp)
            self._move_into_place(tmp, final)
        except BaseException:
            self.abort(tmp)
            raise
        log.info("checkpoint step %d written to %s", step, final)

        if self.background_upload:
            self._queue_upload(final)
        elif self.bucket is not None:
            # just written and hashed; raises CheckpointUploadError, and then nothing is pruned
            self.upload(final, verify_local=False)
            self._prune_remote()
        self._prune_local()
        return final

    def abort(self, tmp: Path) -> None:
        """Delete an unpublished checkpoint's temporary directory (`begin`)."""
        self._parts.pop(tmp, None)
        shutil.rmtree(tmp, ignore_errors=True)

    def load(self, path_or_step: int | str | Path) -> tuple[dict[str, Any], dict]:
        """`(parts, meta)` of a verified checkpoint (a step of this store, or a directory path).

        Every file is checked against the manifest (size and sha256) first; a mismatch, a missing
        manifest or a listed file that is not .safetensors/.json raises CheckpointError naming the
        file. Tensors come back on CPU.
        """
        if isinstance(path_or_step, int) and not isinstance(path_or_step, bool):
            path = self.path_for(path_or_step)
        else:
            path = Path(path_or_step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint directory {path}; CheckpointStore.list_valid() lists the "
                                  f"loadable ones")
        manifest = verify_checkpoint(path)
        remedy = "resume from another checkpoint (CheckpointStore.latest_valid() skips damaged ones)"
        parts: dict[str, Any] = {}
        for name in manifest["parts"]:
            sidecar = parse_json((path / f"{name}.json").read_bytes(), str(path / f"{name}.json"), remedy)
            try:
                skeleton = sidecar["skeleton"]
            except (KeyError, TypeError) as exc:
                raise CheckpointError(f"{path / (name + '.json')} is not a checkpoint skeleton ({exc})") from exc
            tensors = safetensors.torch.load_file(path / f"{name}.safetensors")
            try:
                parts[name] = unflatten_state(tensors, skeleton)
            except CheckpointError as exc:
                raise CheckpointError(f"{path / (name + '.safetensors')}: {exc}") from exc
        meta = parse_json((path / META).read_bytes(), str(path / META), remedy)
        return parts, meta

    def list_valid(self) -> list[Path]:
        """Local checkpoint directories that pass `verify_checkpoint` (checksums), oldest first."""
        return [p for p in self._step_dirs() if self._is_valid(p)]

    def latest_valid(self, prefer_remote_if_local_missing: bool = True) -> Path | None:
        """The newest checkpoint that verifies, local or remote; None when there is none anywhere.

        With a remote configured (and `prefer_remote_if_local_missing`), local and remote steps are
        considered together, newest first: a step whose local copy is missing or damaged (a truncated
        file, a crash mid-copy) is restored from its remote copy instead of falling back to an older
        step, whose next save would overwrite the intact remote one. A remote copy that is itself
        damaged is skipped with a warning naming it. When the remote cannot be listed or a download
        fails for a transient reason (the endpoint down past botocore's retries), this raises
        CheckpointUnavailable rather than silently resuming from an older step. Every step passed over
        is logged as a warning.
        """
        local = self._step_dirs()
        valid = {checkpoint_step(p): p for p in local if self._is_valid(p)}
        damaged = sorted(checkpoint_step(p) for p in local if checkpoint_step(p) not in valid)
        remote: list[int] = []
        if self.bucket is not None and prefer_remote_if_local_missing:
            remote = self.list_remote()  # raises CheckpointUnavailable when the endpoint stays down
        skipped: list[str] = []
        for step in sorted(set(valid) | set(remote), reverse=True):
            if step in valid:
                chosen = valid[step]
                break
            try:
                chosen = self.download(step)
                break
            except CheckpointUnavailable as exc:
                raise CheckpointUnavailable(redact_message(
                    f"checkpoint step {step} is on {self.remote_uri} but could not be downloaded: {exc}. Not resuming "
                    f"from an older step (its next save would overwrite step {step}); retry when the endpoint "
                    f"(AWS_ENDPOINT_URL) is reachable")) from None
            except CheckpointError as exc:
                skipped.append(f"step {step} (remote copy damaged: {redact_message(str(exc))})")
        else:
            chosen = None
        newest_chosen = checkpoint_step(chosen) if chosen is not None else -1
        skipped += [f"step {s} (local copy damaged, no remote copy)" for s in damaged
                    if s > newest_chosen and s not in remote]
        if skipped:
            log.warning("resuming from %s, passing over newer %s",
                        f"step {newest_chosen}" if chosen is not None else "the start", "; ".join(skipped))
        return chosen

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(dirs, key=checkpoint_step)

    def _is_valid(self, path: Path) -> bool:
        try:
            verify_checkpoint(path)
            return True
        except CheckpointError as exc:
            log.warning("ignoring checkpoint %s: %s", path, exc)
            return False

    def _remove_stale_tmp_dirs(self) -> None:
        # one writer per run directory (the driver); a leftover temp dir is from a crashed save
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            if stale.is_dir():
                log.info("removing stale temporary checkpoint directory %s", stale)
                shutil.rmtree(stale, ignore_errors=True)

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        """Rename `tmp` to `final`; an existing `final` (same step, rewritten) is renamed away first."""
        old = None
        if final.exists():
            old = final.parent / f"{TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune_local(self) -> None:
        dirs = self._step_dirs()
        complete = [p for p in dirs if (p / MANIFEST).is_file()]
        if len(complete) <= self.keep:
            return
        oldest_kept = checkpoint_step(complete[-self.keep])
        with self._uploads:
            busy = {self._pending, self._uploading}
        for path in dirs:
            if checkpoint_step(path) < oldest_kept and path not in busy:
                log.info("pruning local checkpoint %s (keep=%d)", path, self.keep)
                doomed = path.parent / f"{TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, doomed)  # so a crash mid-delete leaves no half step dir
                shutil.rmtree(doomed, ignore_errors=True)
