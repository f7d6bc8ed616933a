"""Checkpoint storage: atomic checkpoint directories on local disk, mirrored to S3 with boto3.

Layout of one checkpoint (`root` is e.g. `runs/<name>/checkpoints`)::

    root/step_00000040/
        __0_0.distcp, __1_0.distcp  the trainer ranks' tensor shards (infra.checkpoint_shards), one file per rank
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
`prefix/step_XXXXXXXX/<file>` (manifest last, multipart for large files) and verified (size and
sha256 of every object) before older checkpoints are pruned. A failed upload raises
`CheckpointUploadError`; the local checkpoint and its predecessors stay. With `background_upload=True`
(what training runs use) the upload runs in a thread, so training continues on local checkpoints
while S3 is down, and the upload catches up when it is back; `flush()` waits for it. `upload_dir` /
`download_dir` carry a directory of any files (the final model, `<prefix>/final_model/`) the same way:
retried, every object verified, a listing (`manifest.json`) written last and checked on download.

What is retried: transient S3 errors (connection errors, timeouts, 5xx, throttling/SlowDown,
RequestTimeout) are retried with exponential backoff and jitter for up to S3_RETRY_BUDGET_S seconds
in all (long enough to ride out an endpoint restart; `retry_budget_s=` or the environment variable
POSTTRAIN_S3_RETRY_BUDGET_S override it). Anything else (an invalid request such as a bad bucket
name, NoSuchBucket, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, missing credentials)
fails at once, naming the URI and what to fix.

Credentials come only from the environment / AWS profiles (boto3's own chain): a URI with
`user:password@` is refused, and every message and log line goes through `rl_core.redact`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch

from infra.checkpoint_format import (  # noqa: F401 - re-exported: the checkpoint API is infra.storage's
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
    fsync_dir,
    fsync_file,
    sha256_file,
    step_dir_name,
    unflatten_state,
    verify_checkpoint,
    write_durably,
    write_json,
)
from infra.s3 import (  # noqa: F401 - re-exported
    JITTER,
    RETRY_BUDGET_ENV,
    S3_RETRY_BUDGET_S,
    S3Failure,
    budget_from_env,
    chunks,
    client_error,
    is_transient_s3_error,
    parse_s3_uri,
    s3_error_fix,
)
from rl_core.redact import redact_message

log = logging.getLogger("posttrain.storage")
MiB = 1024 * 1024
FINAL_MODEL = "final_model"  # the final model's directory, in the run directory and under the run's remote prefix


class CheckpointUnavailable(CheckpointError):
    """The remote store could not be reached (transient errors past the retry budget); nothing is damaged."""


class CheckpointUploadError(CheckpointError):
    """The upload to S3 failed after all retries; `local_path` is the intact local checkpoint."""

    def __init__(self, message: str, local_path: Path):
        super().__init__(message)
        self.local_path = local_path


# ----------------------------------------------------------------------------------------- store

class CheckpointStore:
    """Atomic checkpoints under `root`, kept to the newest `keep`, optionally mirrored to S3.

    Args:
      root: the checkpoint directory of a run, e.g. `runs/<name>/checkpoints` (created on save).
      keep: how many checkpoints to keep, locally and remotely (>= 1).
      remote_uri: `s3://bucket/prefix`, or None for local only.
      s3_client: a boto3 S3 client; default `boto3.client("s3", endpoint_url=endpoint_url)`, which
        honours `AWS_ENDPOINT_URL` and takes credentials from the environment / AWS profiles only.
      endpoint_url: an explicit S3 endpoint (else `AWS_ENDPOINT_URL` or AWS).
      retry_budget_s: how long (seconds, in all) one S3 call is retried on transient errors; None
        reads POSTTRAIN_S3_RETRY_BUDGET_S, else S3_RETRY_BUDGET_S. Other errors are not retried.
      retry_base_delay_s / retry_max_delay_s: between tries it sleeps base * 2**i, capped at max, with
        jitter (a uniform draw from half of that to all of it), never past the budget.
      upload_attempts: an optional cap on the tries of one call (None: the budget alone decides).
      background_upload: upload from a background thread, so `save` returns once the local checkpoint is
        in place and training goes on while S3 is slow or briefly down. One upload runs at a time; a
        checkpoint still waiting when a newer one is saved is skipped (the newer one supersedes it).
        A background upload that fails for good is raised by the next `save` or by `flush()`.
      multipart_threshold / multipart_chunksize: files of at least the threshold are uploaded in
        parts of chunksize bytes (S3 requires parts of >= 5 MiB except the last).
    """

    def __init__(self, root: str | Path, *, keep: int = 3, remote_uri: str | None = None, s3_client=None,
                 endpoint_url: str | None = None, upload_attempts: int | None = None,
                 retry_base_delay_s: float = 0.5, retry_max_delay_s: float = 30.0,
                 retry_budget_s: float | None = None, multipart_threshold: int = 64 * MiB,
                 multipart_chunksize: int = 16 * MiB, max_concurrency: int = 4, background_upload: bool = False):
        if int(keep) < 1:
            raise ValueError(f"keep={keep}: at least the newest checkpoint must be kept (keep >= 1)")
        if upload_attempts is not None and int(upload_attempts) < 1:
            raise ValueError(f"upload_attempts={upload_attempts}: must be >= 1 (or None: no cap)")
        if retry_budget_s is None:
            retry_budget_s = budget_from_env()
        if not float(retry_budget_s) >= 0:
            raise ValueError(f"retry_budget_s={retry_budget_s}: must be >= 0 seconds")
        if multipart_chunksize < 5 * MiB:
            raise ValueError(f"multipart_chunksize={multipart_chunksize}: S3 parts must be >= 5 MiB")
        self.root = Path(root)
        self.keep = int(keep)
        self.remote_uri = remote_uri
        self.bucket, self.prefix = parse_s3_uri(remote_uri) if remote_uri else (None, "")
        self._s3 = s3_client
        self.endpoint_url = endpoint_url
        self.upload_attempts = None if upload_attempts is None else int(upload_attempts)
        self.retry_budget_s = float(retry_budget_s)
        self.retry_base_delay_s = float(retry_base_delay_s)
        self.retry_max_delay_s = float(retry_max_delay_s)
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

    # --------------------------------------------------------------------------- background uploads

    def _queue_upload(self, path: Path) -> None:
        with self._uploads:
            if self._pending is not None:
                log.info("checkpoint %s not uploaded: superseded by %s before its upload started", self._pending.name,
                         path.name)
            self._pending = path
            if self._uploader is None or not self._uploader.is_alive():
                self._uploader = threading.Thread(target=self._upload_loop, name="checkpoint-upload", daemon=True)
                self._uploader.start()
            self._uploads.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._uploads:
                if self._pending is None or self._upload_error is not None:
                    self._uploader = None
                    self._uploads.notify_all()
                    return
                path, self._pending, self._uploading = self._pending, None, self._pending
            try:
                self.upload(path, verify_local=False)
                self._prune_remote()
            except CheckpointUploadError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - reported to the training thread, never lost
                error = CheckpointUploadError(redact_message(f"uploading checkpoint {path} failed: "
                                                             f"{type(exc).__name__}: {exc}"), local_path=path)
            else:
                error = None
            with self._uploads:
                self._uploading = None
                if error is not None:
                    log.warning("%s", error)
                    self._upload_error = error
                self._uploads.notify_all()

    def _raise_upload_error(self) -> None:
        with self._uploads:
            error, self._upload_error = self._upload_error, None
        if error is not None:
            raise error

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the background upload (if any) to finish; raise CheckpointUploadError when it failed.

        `timeout` (seconds; None: as long as it takes, which the retry budget bounds) raises
        CheckpointUploadError when the upload is still running by then.
        """
        again = None
        with self._uploads:
            if self._pending is not None and self._upload_error is None and (
                    self._uploader is None or not self._uploader.is_alive()):
                again, self._pending = self._pending, None  # left behind by a failure already reported: retry it
        if again is not None:
            self._queue_upload(again)
        with self._uploads:
            # done: nothing waiting or running, or the uploader stopped at a failure (raised below)
            done = self._uploads.wait_for(lambda: self._uploading is None and (
                self._pending is None or self._upload_error is not None), timeout)
        if not done:
            raise CheckpointUploadError(f"the upload of {self._uploading or self._pending} to {self.remote_uri} "
                                        f"was still running after {timeout:g} s", local_path=self._uploading)
        self._raise_upload_error()

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
        parts: dict[str, Any] = {}
        for name in manifest["parts"]:
            try:
                sidecar = json.loads((path / f"{name}.json").read_bytes())
                skeleton = sidecar["skeleton"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{path / (name + '.json')} is not a checkpoint skeleton ({exc})") from exc
            tensors = safetensors.torch.load_file(path / f"{name}.safetensors")
            try:
                parts[name] = unflatten_state(tensors, skeleton)
            except CheckpointError as exc:
                raise CheckpointError(f"{path / (name + '.safetensors')}: {exc}") from exc
        meta = json.loads((path / META).read_bytes())
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
        fails for a transient reason (the endpoint down past the retry budget), this raises
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

    # ------------------------------------------------------------------------------------- remote

    @property
    def s3(self):
        if self._s3 is None:
            import boto3  # credentials: environment / AWS profiles only (boto3's default chain)
            self._s3 = boto3.client("s3", endpoint_url=self.endpoint_url or None)
        return self._s3

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(x for x in (self.prefix, step_dir_name(step), name) if x)

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, retried on transient S3 errors until `retry_budget_s` is spent (or `upload_attempts`
        tries); any other S3 error raises S3Failure at once with what to fix. Each failure is logged
        as "<what> failed (attempt n ...)"."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        caught = (ClientError, BotoCoreError, Boto3Error, ConnectionError, TimeoutError)
        what = redact_message(what)
        start = time.monotonic()
        deadline = start + self.retry_budget_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except caught as exc:
                reason = redact_message(f"{type(exc).__name__}: {exc}")
                if not is_transient_s3_error(exc):
                    log.warning("%s failed (attempt %d): %s; not retried: not a transient error", what, attempt,
                                reason)
                    error = client_error(exc)
                    code = str(error.response.get("Error", {}).get("Code", "")) if error is not None else ""
                    raise S3Failure(what, attempt, reason,
                                     f"not retried: this error is not transient; {s3_error_fix(exc)}",
                                     missing=code in ("NoSuchKey", "404")) from None
                now = time.monotonic()
                capped = self.upload_attempts is not None and attempt >= self.upload_attempts
                if now >= deadline or capped:
                    log.warning("%s failed (attempt %d, %.1f s): %s; giving up", what, attempt, now - start, reason)
                    limit = (f"upload_attempts={self.upload_attempts} reached" if capped else
                             f"transient errors are retried for {self.retry_budget_s:g} s ({RETRY_BUDGET_ENV})")
                    raise S3Failure(what, attempt, reason,
                                     f"{limit}; gave up after {now - start:.1f} s: check that the endpoint "
                                     f"(AWS_ENDPOINT_URL) is up and reachable") from None
                cap = min(self.retry_max_delay_s, self.retry_base_delay_s * 2 ** min(attempt - 1, 60))
                delay = min(JITTER.uniform(cap / 2, cap), deadline - now)
                log.warning("%s failed (attempt %d, %.1f s of %g s): %s; transient, retrying in %.2f s", what,
                            attempt, now - start, self.retry_budget_s, reason, delay)
                time.sleep(delay)

    def upload(self, path: str | Path, *, verify_local: bool = True) -> None:
        """Upload a complete local checkpoint (manifest last) and verify every object's size and sha256.

        Raises CheckpointUploadError after the retries are spent; the local directory is untouched.
        """
        path = Path(path)
        manifest = verify_checkpoint(path, check_hashes=verify_local)
        step = manifest["step"]
        if self.bucket is None:
            raise CheckpointError("upload: this CheckpointStore has no remote_uri")
        files = dict(manifest["files"])
        files[MANIFEST] = {"size": (path / MANIFEST).stat().st_size, "sha256": sha256_file(path / MANIFEST)}
        data_files = sorted(n for n in files if n != MANIFEST)

        def put(name: str) -> None:
            self._put_file(path / name, self._key(step, name), files[name]["sha256"])

        def put_and_verify() -> None:
            # a rewritten step: drop the old manifest first so the remote copy is never "complete"
            # with a mix of old and new files
            self._retry(f"delete old s3://{self.bucket}/{self._key(step, MANIFEST)}",
                        lambda: self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MANIFEST)))
            for name in data_files:
                put(name)
            for name in data_files:  # every object verified before the manifest makes the step look complete
                self._verify_remote_object(step, name, files[name])
            put(MANIFEST)
            self._verify_remote_object(step, MANIFEST, files[MANIFEST])
            remote_manifest = self._retry(
                f"read back s3://{self.bucket}/{self._key(step, MANIFEST)}",
                lambda: self.s3.get_object(Bucket=self.bucket, Key=self._key(step, MANIFEST))["Body"].read())
            if hashlib.sha256(remote_manifest).hexdigest() != files[MANIFEST]["sha256"]:
                raise S3Failure(f"verify s3://{self.bucket}/{self._key(step, MANIFEST)}", 1,
                                "the manifest read back differs from the local one", missing=True)

        try:
            try:
                put_and_verify()
            except S3Failure as exc:
                if not exc.missing:
                    raise
                # an object uploaded earlier is gone or altered (the endpoint lost it while it was down):
                # the local checkpoint is the truth, so the whole step is uploaded once more
                log.warning("%s; uploading step %d again", exc, step)
                put_and_verify()
        except S3Failure as exc:
            raise CheckpointUploadError(redact_message(
                f"uploading checkpoint {path} to {self.remote_uri} failed: {exc}. The local checkpoint is "
                f"intact and older checkpoints were not pruned; check the endpoint (AWS_ENDPOINT_URL), the "
                f"bucket and the credentials in the environment, then call CheckpointStore.upload({str(path)!r}) "
                f"or save again"), local_path=path) from None
        log.info("checkpoint step %d uploaded to %s and verified", step, self.remote_uri)

    def _put_file(self, file: Path, key: str, sha256: str) -> None:
        """Upload one file to `key` (multipart when large), its sha256 in the object's metadata; retried."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=self.multipart_threshold,
                                multipart_chunksize=self.multipart_chunksize, max_concurrency=self.max_concurrency)
        self._retry(f"upload {file} to s3://{self.bucket}/{key}", lambda: self.s3.upload_file(
            str(file), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}}, Config=config))

    def _verify_remote_object(self, step: int, name: str, entry: dict) -> None:
        self._verify_key(self._key(step, name), entry)

    def _verify_key(self, key: str, entry: dict) -> None:
        head = self._retry(f"head s3://{self.bucket}/{key}",
                           lambda: self.s3.head_object(Bucket=self.bucket, Key=key))
        size, digest = head.get("ContentLength"), (head.get("Metadata") or {}).get("sha256")
        if size != entry["size"] or digest != entry["sha256"]:
            raise S3Failure(f"verify s3://{self.bucket}/{key}", 1,
                            f"remote object has size {size} and sha256 {digest}, the local file "
                            f"{entry['size']} and {entry['sha256']}", missing=True)

    def upload_dir(self, path: str | Path, name: str) -> str:
        """Upload the directory `path` (any files, subdirectories included) to `<remote_uri>/<name>/`, as
        checkpoints are uploaded: retried, every object's size and sha256 verified, and a listing of them
        (`<name>/manifest.json`) written last, so a copy without it is incomplete. Objects of an earlier upload
        of `name` are deleted first (listing first). Returns the URI. Raises CheckpointUploadError.
        """
        path = Path(path)
        if self.bucket is None:
            raise CheckpointError("upload_dir: this CheckpointStore has no remote_uri")
        files = {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "sha256": sha256_file(f)}
                 for f in sorted(path.rglob("*")) if f.is_file()}
        base = "/".join(x for x in (self.prefix, name) if x)
        uri = f"s3://{self.bucket}/{base}"
        listing = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
        try:
            old = self._retry(f"list {uri}/", lambda: [
                obj["Key"] for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base + "/") for obj in page.get("Contents", [])])
            old.sort(key=lambda k: k != f"{base}/{MANIFEST}")  # the listing first: never complete with old files
            for batch in chunks(old, 1000):
                self._retry(f"delete {len(batch)} objects under {uri}", lambda batch=batch: self.s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
            for rel, entry in files.items():
                self._put_file(path / rel, f"{base}/{rel}", entry["sha256"])
                self._verify_key(f"{base}/{rel}", entry)
            self._retry(f"put {uri}/{MANIFEST}", lambda: self.s3.put_object(
                Bucket=self.bucket, Key=f"{base}/{MANIFEST}", Body=listing))
        except S3Failure as exc:
            raise CheckpointUploadError(redact_message(
                f"uploading {path} to {uri} failed: {exc}. The local directory is intact; check the endpoint "
                "(AWS_ENDPOINT_URL), the bucket and the credentials in the environment of the process that "
                "uploads"), local_path=path) from None
        log.info("%s uploaded to %s and verified", path, uri)
        return uri

    def download_dir(self, name: str, dest: str | Path) -> Path:
        """Download what `upload_dir(..., name)` uploaded into `dest` (replaced), every file checked against the
        listing (size and sha256) before `dest` is put in place. Raises CheckpointError."""
        dest = Path(dest)
        if self.bucket is None:
            raise CheckpointError("download_dir: this CheckpointStore has no remote_uri")
        base = "/".join(x for x in (self.prefix, name) if x)
        uri = f"s3://{self.bucket}/{base}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{TMP_PREFIX}download-{dest.name}-{uuid.uuid4().hex[:8]}"
        try:
            try:
                listing = json.loads(self._retry(f"get {uri}/{MANIFEST}", lambda: self.s3.get_object(
                    Bucket=self.bucket, Key=f"{base}/{MANIFEST}")["Body"].read()))["files"]
                for rel, entry in listing.items():
                    target = (tmp / rel).resolve()
                    if not target.is_relative_to(tmp.resolve()):
                        raise CheckpointError(f"{uri}/{MANIFEST} lists {rel!r}, outside the directory")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self._retry(f"download {uri}/{rel}", lambda rel=rel, target=target: self.s3.download_file(
                        self.bucket, f"{base}/{rel}", str(target)))
                    if target.stat().st_size != entry["size"] or sha256_file(target) != entry["sha256"]:
                        raise CheckpointError(f"{uri}/{rel} does not match its size and sha256 in {MANIFEST}")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{uri}/{MANIFEST} is not a listing of files ({exc})") from exc
            except S3Failure as exc:
                raise CheckpointError(redact_message(f"downloading {uri} failed: {exc}")) from None
            if dest.exists():
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("%s downloaded to %s and verified", uri, dest)
        return dest

    def _list_remote_keys(self) -> dict[int, list[str]]:
        keys: dict[int, list[str]] = {}
        base = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                out.extend(obj["Key"] for obj in page.get("Contents", []))
            return out

        try:
            all_keys = self._retry(f"list s3://{self.bucket}/{base}", list_all)
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"listing {self.remote_uri} failed: {exc}; check AWS_ENDPOINT_URL, "
                                                 f"the bucket and the credentials in the environment")) from None
        for key in all_keys:
            rest = key[len(base):].split("/")
            if len(rest) == 2 and STEP_DIR.match(rest[0]):
                keys.setdefault(checkpoint_step(rest[0]), []).append(key)
        return keys

    def remote_children(self) -> list[str]:
        """The names of the 'directories' directly under `remote_uri` (empty for a local-only store)."""
        if self.bucket is None:
            return []
        base = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                          Delimiter="/"):
                out.extend(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
            return out

        try:
            return self._retry(f"list s3://{self.bucket}/{base}", list_all)
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"listing {self.remote_uri} failed: {exc}")) from None

    def read_remote_json(self, name: str) -> dict | None:
        """The JSON object `<remote_uri>/<name>`, None when there is none (or it is not a JSON object)."""
        key = "/".join(x for x in (self.prefix, name) if x)
        try:
            body = self._retry(f"get s3://{self.bucket}/{key}",
                               lambda: self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except S3Failure as exc:
            if exc.missing:
                return None
            raise CheckpointUnavailable(redact_message(f"reading s3://{self.bucket}/{key} failed: {exc}")) from None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def write_remote_json(self, name: str, data: Mapping[str, Any]) -> None:
        key = "/".join(x for x in (self.prefix, name) if x)
        body = json.dumps(data, indent=1, sort_keys=True).encode()
        try:
            self._retry(f"put s3://{self.bucket}/{key}",
                        lambda: self.s3.put_object(Bucket=self.bucket, Key=key, Body=body))
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"writing s3://{self.bucket}/{key} failed: {exc}")) from None

    def list_remote(self) -> list[int]:
        """Steps with a manifest under `remote_uri`, oldest first (validity is checked on download)."""
        if self.bucket is None:
            return []
        return sorted(step for step, keys in self._list_remote_keys().items()
                      if self._key(step, MANIFEST) in keys)

    def download(self, step: int) -> Path:
        """Download remote checkpoint `step` into `root`, verify it, and return its directory."""
        if self.bucket is None:
            raise CheckpointError("download: this CheckpointStore has no remote_uri")
        remote = f"s3://{self.bucket}/{self._key(step)}"
        remedy = f"the remote checkpoint {remote} is damaged; use an older step or delete it"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}download-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            try:
                body = self._retry(f"get {remote}/{MANIFEST}", lambda: self.s3.get_object(
                    Bucket=self.bucket, Key=self._key(step, MANIFEST))["Body"].read())
                manifest = json.loads(body)
            except ValueError as exc:
                raise CheckpointError(f"{remote}/{MANIFEST} is not valid JSON ({exc}); {remedy}") from exc
            check_manifest_structure(manifest, f"{remote}/{MANIFEST}", remedy)
            if manifest["step"] != step:
                raise CheckpointError(f"{remote}/{MANIFEST} records step {manifest['step']}; {remedy}")
            for name in manifest["files"]:
                self._retry(f"download {remote}/{name}", lambda name=name: self.s3.download_file(
                    self.bucket, self._key(step, name), str(tmp / name)))
                fsync_file(tmp / name)
            manifest_file = tmp / MANIFEST
            manifest_file.write_bytes(body)
            fsync_file(manifest_file)
            fsync_dir(tmp)
            verify_checkpoint(tmp)  # sizes and sha256 of what arrived
            self._move_into_place(tmp, self.path_for(step))
        except S3Failure as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # an object missing from a listed step is damage (skip the step); anything else (the endpoint
            # down past the budget, credentials) says nothing about the checkpoint
            error = CheckpointError if exc.missing else CheckpointUnavailable
            raise error(redact_message(f"downloading {remote} failed: {exc}")) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("checkpoint step %d restored from %s to %s", step, remote, self.path_for(step))
        return self.path_for(step)

    def delete_remote(self) -> int:
        """Delete every checkpoint object under `remote_uri` (a fresh run that overwrites an old one).

        Manifests go first, so an interrupted delete never leaves a step that looks complete.
        Returns the number of objects deleted.
        """
        if self.bucket is None:
            return 0
        doomed = [k for keys in self._list_remote_keys().values() for k in keys]
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in chunks(doomed, 1000):
            self._retry(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        return len(doomed)

    def _prune_remote(self) -> None:
        by_step = self._list_remote_keys()
        complete = sorted(s for s, keys in by_step.items() if self._key(s, MANIFEST) in keys)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        doomed = [k for s, keys in by_step.items() if s < oldest_kept for k in keys]
        # manifests first: a half-deleted step must never look complete
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in chunks(doomed, 1000):
            self._retry(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        if doomed:
            log.info("pruned remote checkpoints older than step %d (keep=%d)", oldest_kept, self.keep)
