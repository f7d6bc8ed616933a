"""Directories and JSON objects of any kind under a `CheckpointStore`'s remote prefix, beside its checkpoints (the
final model, `<prefix>/final_model/`; run records): carried the way checkpoints are, with SHA256 checksums S3 checks
and stores, every object verified, a listing written last and checked on download. A mixin of `CheckpointStore`, on
its S3 mirror."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.checkpoints.format import MANIFEST, TMP_PREFIX, CheckpointError, parse_json, sha256_file
from infra.checkpoints.remote import CheckpointUnavailable, CheckpointUploadError
from infra.checkpoints.s3 import CHECKSUM, S3Failure, chunks, sha256_b64
from rl_core.redact import redact_message

log = logging.getLogger("posttrain.storage")


class RemoteFiles:
    """`upload_dir` / `download_dir`, `remote_children` and `read_remote_json` / `write_remote_json`."""

    def upload_dir(self, path: str | Path, name: str) -> str:
        """Upload the directory `path` (any files, subdirectories included) to `<remote_uri>/<name>/`, as
        checkpoints are uploaded: every object's size and S3's SHA256 checksum verified, and a listing of them
        (`<name>/manifest.json`) written last, so a copy without it is incomplete. Objects of an earlier upload
        of `name` are deleted first (listing first). Returns the URI. Raises CheckpointUploadError.
        """
        path = Path(path)
        if self.bucket is None:
            raise CheckpointError("upload_dir: this CheckpointStore has no remote_uri")
        self.check_lease()  # one writer per prefix (`infra.checkpoints.lease`)
        files = {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "sha256": sha256_file(f)}
                 for f in sorted(path.rglob("*")) if f.is_file()}
        base = "/".join(x for x in (self.prefix, name) if x)
        uri = f"s3://{self.bucket}/{base}"
        listing = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
        try:
            old = self._call(f"list {uri}/", lambda: [
                obj["Key"] for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base + "/") for obj in page.get("Contents", [])])
            old.sort(key=lambda k: k != f"{base}/{MANIFEST}")  # the listing first: never complete with old files
            for batch in chunks(old, 1000):
                self._call(f"delete {len(batch)} objects under {uri}", lambda batch=batch: self.s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}))
            for rel, entry in files.items():
                self._put_file(path / rel, f"{base}/{rel}")
                self._verify_key(f"{base}/{rel}", entry, path / rel)
            self._put_bytes(f"{base}/{MANIFEST}", listing)
        except S3Failure as exc:
            raise CheckpointUploadError(redact_message(
                f"uploading {path} to {uri} failed: {exc}. The local directory is intact; check the endpoint "
                "(AWS_ENDPOINT_URL), the bucket and the credentials in the environment of the process that "
                "uploads"), local_path=path) from None
        log.info("%s uploaded to %s and verified", path, uri)
        return uri

    def download_dir(self, name: str, dest: str | Path) -> Path:
        """Download what `upload_dir(..., name)` uploaded into `dest` (replaced), every file checked by botocore against
        S3's checksum as it arrives and against the listing (size and sha256) before `dest` is put in place. Raises
        CheckpointError."""
        dest = Path(dest)
        if self.bucket is None:
            raise CheckpointError("download_dir: this CheckpointStore has no remote_uri")
        base = "/".join(x for x in (self.prefix, name) if x)
        uri = f"s3://{self.bucket}/{base}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{TMP_PREFIX}download-{dest.name}-{uuid.uuid4().hex[:8]}"
        try:
            try:
                listing = parse_json(self._call(f"get {uri}/{MANIFEST}", lambda: self.s3.get_object(
                    Bucket=self.bucket, Key=f"{base}/{MANIFEST}", ChecksumMode="ENABLED")["Body"].read()),
                    f"{uri}/{MANIFEST}", "upload the directory again")["files"]
                for rel, entry in listing.items():
                    target = (tmp / rel).resolve()
                    if not target.is_relative_to(tmp.resolve()):
                        raise CheckpointError(f"{uri}/{MANIFEST} lists {rel!r}, outside the directory")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self._call(f"download {uri}/{rel}", lambda rel=rel, target=target: self.s3.download_file(
                        self.bucket, f"{base}/{rel}", str(target), ExtraArgs={"ChecksumMode": "ENABLED"},
                        Config=self.transfer))
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
            return self._call(f"list s3://{self.bucket}/{base}", list_all)
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"listing {self.remote_uri} failed: {exc}")) from None

    def read_remote_json(self, name: str) -> dict | None:
        """The JSON object `<remote_uri>/<name>`, None when there is none (or it is not a JSON object)."""
        key = "/".join(x for x in (self.prefix, name) if x)
        try:
            body = self._call(f"get s3://{self.bucket}/{key}", lambda: self.s3.get_object(
                Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")["Body"].read())
        except S3Failure as exc:
            if exc.damaged:
                return None
            raise CheckpointUnavailable(redact_message(f"reading s3://{self.bucket}/{key} failed: {exc}")) from None
        try:
            data = parse_json(body, f"s3://{self.bucket}/{key}", "")
        except CheckpointError:  # garbage or nested 100k deep: as if there were none
            return None
        return data if isinstance(data, dict) else None

    def write_remote_json(self, name: str, data: Mapping[str, Any]) -> None:
        self.check_lease()
        key = "/".join(x for x in (self.prefix, name) if x)
        body = json.dumps(data, indent=1, sort_keys=True).encode()
        try:
            self._put_bytes(key, body)
        except S3Failure as exc:
            raise CheckpointUnavailable(redact_message(f"writing s3://{self.bucket}/{key} failed: {exc}")) from None

    def _put_bytes(self, key: str, body: bytes) -> None:
        """PUT `body` to `key` with a SHA256 checksum; S3 checks it, and the one it stored must be `body`'s."""
        stored = self._call(f"put s3://{self.bucket}/{key}", lambda: self.s3.put_object(
            Bucket=self.bucket, Key=key, Body=body, ChecksumAlgorithm=CHECKSUM)).get(f"Checksum{CHECKSUM}")
        if stored != sha256_b64(hashlib.sha256(body).hexdigest()):
            raise S3Failure(f"verify s3://{self.bucket}/{key}", f"S3 stored SHA256 checksum {stored} for the bytes sent",
                            damaged=True)
