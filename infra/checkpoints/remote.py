"""The S3 mirror of a `CheckpointStore` (a mixin of it; the store's `__init__` sets the state it reads):
each completed checkpoint uploaded to `prefix/step_XXXXXXXX/<file>` (manifest last, multipart for large files) and
verified against the SHA256 checksums S3 stores, in the foreground or from a background thread; remote steps
listed, downloaded (every byte checked against S3's checksum and the manifest), pruned and deleted. Each request is
retried by botocore itself (`infra.checkpoints.s3.s3_client`, `tracking.s3`)."""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.checkpoints.format import (
    MANIFEST,
    STEP_DIR,
    TMP_PREFIX,
    CheckpointError,
    check_manifest_structure,
    checkpoint_step,
    parse_json,
    sha256_file,
    step_dir_name,
    verify_checkpoint,
)
from infra.checkpoints.s3 import (
    CHECKSUM,
    S3Failure,
    checksum_matches,
    chunks,
    expected_sha256,
    s3_client,
    s3_failure,
)
from rl_core.atomic import fsync_dir, fsync_file
from rl_core.redact import redact_message

log = logging.getLogger("posttrain.storage")


class CheckpointUnavailable(CheckpointError):
    """The remote store could not be reached (botocore's retries spent); nothing is damaged."""


class CheckpointUploadError(CheckpointError):
    """The upload to S3 failed after all retries; `local_path` is the intact local checkpoint."""

    def __init__(self, message: str, local_path: Path):
        super().__init__(message)
        self.local_path = local_path


class RemoteCheckpoints:
    """Uploads (foreground and background), downloads, listing and pruning of the store's checkpoints on S3."""

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

        `timeout` (seconds; None: as long as it takes, which `tracking.s3` bounds) raises
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

    @property
    def s3(self):
        if self._s3 is None:
            self._s3 = s3_client(self.s3_config, self.endpoint_url)
        return self._s3

    @property
    def transfer(self):
        """How `upload_file` / `download_file` split a file: multipart from `multipart_threshold` bytes on, in parts
        of `multipart_chunksize`; always s3transfer's own client, whose part layout `expected_sha256` follows."""
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=self.max_concurrency, preferred_transfer_client="classic")

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(x for x in (self.prefix, step_dir_name(step), name) if x)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, one S3 call (botocore retries its requests); a failure raises S3Failure naming `what`."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (ClientError, BotoCoreError, Boto3Error, ConnectionError, TimeoutError) as exc:
            raise s3_failure(what, exc, self.s3_config.max_attempts) from None

    def upload(self, path: str | Path, *, verify_local: bool = True) -> None:
        """Upload a complete local checkpoint (manifest last) and verify every object's size and S3's SHA256
        checksum of it against the local file.

        Raises CheckpointUploadError when S3 fails for good; the local directory is untouched.
        """
        path = Path(path)
        manifest = verify_checkpoint(path, check_hashes=verify_local)
        step = manifest["step"]
        if self.bucket is None:
            raise CheckpointError("upload: this CheckpointStore has no remote_uri")
        self.check_lease()  # one writer per prefix (`infra.checkpoints.lease`)
        files = dict(manifest["files"])
        files[MANIFEST] = {"size": (path / MANIFEST).stat().st_size, "sha256": sha256_file(path / MANIFEST)}
        data_files = sorted(n for n in files if n != MANIFEST)

        def put_and_verify() -> None:
            # a rewritten step: drop the old manifest first so the remote copy is never "complete"
            # with a mix of old and new files
            self._call(f"delete old s3://{self.bucket}/{self._key(step, MANIFEST)}",
                       lambda: self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MANIFEST)))
            for name in data_files:
                self._put_file(path / name, self._key(step, name))
            for name in data_files:  # every object verified before the manifest makes the step look complete
                self._verify_key(self._key(step, name), files[name], path / name)
            self._put_file(path / MANIFEST, self._key(step, MANIFEST))
            self._verify_key(self._key(step, MANIFEST), files[MANIFEST], path / MANIFEST)

        try:
            try:
                put_and_verify()
            except S3Failure as exc:
                if not exc.damaged:
                    raise
                # an object uploaded earlier is gone or not the local bytes (the endpoint lost it while it was down,
                # the transfer was corrupted): a whole-protocol repair botocore's per-request retries cannot make.
                # The local checkpoint is the truth, so the whole step is uploaded once more
                log.warning("%s; uploading step %d again", exc, step)
                put_and_verify()
        except S3Failure as exc:
            raise CheckpointUploadError(redact_message(
                f"uploading checkpoint {path} to {self.remote_uri} failed: {exc}. The local checkpoint is "
                f"intact and older checkpoints were not pruned; check the endpoint (AWS_ENDPOINT_URL), the "
                f"bucket and the credentials in the environment, then call CheckpointStore.upload({str(path)!r}) "
                f"or save again"), local_path=path) from None
        log.info("checkpoint step %d uploaded to %s and verified", step, self.remote_uri)

    def _put_file(self, file: Path, key: str) -> None:
        """Upload one file to `key` (multipart when large) with a SHA256 checksum, which S3 checks and stores."""
        self._call(f"upload {file} to s3://{self.bucket}/{key}", lambda: self.s3.upload_file(
            str(file), self.bucket, key, ExtraArgs={"ChecksumAlgorithm": CHECKSUM}, Config=self.transfer))

    def _verify_key(self, key: str, entry: dict, file: Path) -> None:
        """The object `key` has the size and the content of the local `file` (`entry`: its manifest size and sha256):
        S3's stored SHA256 checksum (ChecksumMode) is compared with the one the file's bytes give. Raises
        S3Failure (damaged) when not."""
        head = self._call(f"head s3://{self.bucket}/{key}",
                          lambda: self.s3.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"))
        size, stored = head.get("ContentLength"), head.get(f"Checksum{CHECKSUM}")
        try:
            expected, parts = expected_sha256(file, entry["size"], entry["sha256"], self.transfer)
        except ValueError as exc:
            raise CheckpointError(f"{exc}: it changed after it was written; not uploaded as verified") from None
        if size != entry["size"] or not checksum_matches(stored, expected, parts):
            raise S3Failure(f"verify s3://{self.bucket}/{key}",
                            f"the object has {size} bytes and SHA256 checksum {stored}, the local file {entry['size']} "
                            f"bytes and {expected}{f'-{parts}' if parts else ''}", damaged=True)

    def _list_remote_keys(self) -> dict[int, list[str]]:
        keys: dict[int, list[str]] = {}
        base = f"{self.prefix}/" if self.prefix else ""

        def list_all() -> list[str]:
            out = []
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                out.extend(obj["Key"] for obj in page.get("Contents", []))
            return out

        try:
            all_keys = self._call(f"list s3://{self.bucket}/{base}", list_all)
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"listing {self.remote_uri} failed: {exc}; check AWS_ENDPOINT_URL, "
                                                 f"the bucket and the credentials in the environment")) from None
        for key in all_keys:
            rest = key[len(base):].split("/")
            if len(rest) == 2 and STEP_DIR.match(rest[0]):
                keys.setdefault(checkpoint_step(rest[0]), []).append(key)
        return keys

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
            body = self._call(f"get {remote}/{MANIFEST}", lambda: self.s3.get_object(
                Bucket=self.bucket, Key=self._key(step, MANIFEST), ChecksumMode="ENABLED")["Body"].read())
            manifest = parse_json(body, f"{remote}/{MANIFEST}", remedy)
            check_manifest_structure(manifest, f"{remote}/{MANIFEST}", remedy)
            if manifest["step"] != step:
                raise CheckpointError(f"{remote}/{MANIFEST} records step {manifest['step']}; {remedy}")
            for name in manifest["files"]:  # botocore checks a whole-object GET against S3's checksum
                self._call(f"download {remote}/{name}", lambda name=name: self.s3.download_file(
                    self.bucket, self._key(step, name), str(tmp / name), ExtraArgs={"ChecksumMode": "ENABLED"},
                    Config=self.transfer))
                fsync_file(tmp / name)
            manifest_file = tmp / MANIFEST
            manifest_file.write_bytes(body)
            fsync_file(manifest_file)
            fsync_dir(tmp)
            verify_checkpoint(tmp)  # sizes and sha256 of what arrived, against the manifest
            self._move_into_place(tmp, self.path_for(step))
        except S3Failure as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            # an object missing from a listed step or not matching S3's checksum is damage (skip the step); anything
            # else (the endpoint down past botocore's retries, credentials) says nothing about the checkpoint
            error = CheckpointError if exc.damaged else CheckpointUnavailable
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
        self.check_lease()
        doomed = [k for keys in self._list_remote_keys().values() for k in keys]
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in chunks(doomed, 1000):
            self._call(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        return len(doomed)

    def _prune_remote(self) -> None:
        self.check_lease()
        by_step = self._list_remote_keys()
        complete = sorted(s for s, keys in by_step.items() if self._key(s, MANIFEST) in keys)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        doomed = [k for s, keys in by_step.items() if s < oldest_kept for k in keys]
        # manifests first: a half-deleted step must never look complete
        doomed.sort(key=lambda k: not k.endswith("/" + MANIFEST))
        for batch in chunks(doomed, 1000):
            self._call(f"delete {len(batch)} objects under {self.remote_uri}", lambda batch=batch: self.s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
        if doomed:
            log.info("pruned remote checkpoints older than step %d (keep=%d)", oldest_kept, self.keep)
