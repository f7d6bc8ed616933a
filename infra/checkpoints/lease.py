"""One writer per S3 run prefix: the lease `<tracking.checkpoint_uri>/<job.name>/<run id>/lease.json`.

The run lock (`infra.checkpoints.resume.RunLock`) keeps a second run of one run directory off one machine. Two hosts, or two
containers with one checkout path, each hold a lock of their own, and one with no `run_state.json` adopts the run
id that `run.json` on S3 records for its directory path (`infra.checkpoints.resume.run_identity`): both would upload to one
prefix and prune each other's steps. The lease makes the prefix one run's:

- **acquired** with a conditional put (`If-None-Match: *`): the first writer creates `lease.json` (its owner id,
  host, pid, run directory, since when, last renewal, expiry) and reads it back; a second is refused with
  `LeaseHeld`, naming the holder, since when and until when its lease runs;
- **renewed** every `renew_s` (a conditional put, `If-Match` on its ETag) by a thread while the run lives, each
  renewal running `lease_s` on, so a run that dies without releasing it blocks the prefix for `lease_s` at most;
- **released** (deleted, once it is read back as this run's) when the run ends;
- **taken over** when it has expired, with a warning naming the holder (a conditional put on that lease's ETag: of
  two takers, one wins), or at once when its holder held the run lock that this process now holds (the lock file
  names the lease; a `kill -9` of the holder freed the lock, so a restart on that machine does not wait);
- **written again** when a renewal finds it gone and no other run holds it (S3 lost it, or someone deleted it): a
  conditional put as at the start, with a warning;
- **lost** when a renewal finds it is another run's (this run stalled, or S3 was out of reach, past `lease_s`, and
  another host took it over): this run's next upload, prune or record on S3 fails with `LeaseLost` naming the new
  holder (`check`, called by the store before each), so it writes nothing more there.

Expiry compares the holder's clock with the reader's: hosts whose clocks differ by a good part of `lease_s` take an
expired lease late or early.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from infra.checkpoints.format import CheckpointError
from infra.checkpoints.remote import CheckpointUnavailable
from rl_core.redact import redact_message

log = logging.getLogger("posttrain.storage")

LEASE = "lease.json"
LEASE_S = 300.0  # a lease not renewed for this long is stale: another run may take the prefix over
RENEW_S = 60.0  # how often a live run renews its lease
_REFUSED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404")


class LeaseHeld(RuntimeError):
    """Another run holds the S3 prefix's lease."""


class LeaseLost(CheckpointError):
    """This run's lease on its S3 prefix was taken over: it may write nothing more there."""


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def holder(lease: dict[str, Any]) -> str:
    """Who holds `lease`, in words: pid, host, run directory, since when and until when."""
    expires = lease.get("expires")
    until = _utc(expires) if isinstance(expires, (int, float)) else "?"
    return (f"pid {lease.get('pid', '?')} on host {lease.get('host', '?')} (run directory {lease.get('run_dir', '?')}, "
            f"since {lease.get('since', '?')}, renewed {lease.get('renewed', '?')}, lease until {until})")


class S3Lease:
    """The lease of the S3 prefix of `store` (a `CheckpointStore` with a remote_uri) for this process's run of
    `run_dir` (see the module notes). `acquire` it before the run writes anything there and `release` it at the end;
    the store calls `check` before each write."""

    def __init__(self, store: Any, run_dir: str, *, lease_s: float | None = None, renew_s: float | None = None):
        self.store, self.run_dir = store, str(run_dir)
        self.lease_s = float(LEASE_S if lease_s is None else lease_s)
        self.renew_s = float(RENEW_S if renew_s is None else renew_s)
        self.key = "/".join(x for x in (store.prefix, LEASE) if x)
        self.uri = f"s3://{store.bucket}/{self.key}"
        self.owner = uuid.uuid4().hex
        self.since = _utc(time.time())
        self._etag: str | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------------------- S3

    def _body(self) -> bytes:
        now = time.time()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "run_dir": self.run_dir, "since": self.since, "renewed": _utc(now),
                           "expires": now + self.lease_s}, indent=1, sort_keys=True).encode()

    def _s3(self, what: str, fn) -> Any:
        """`fn()`; None when S3 refused it for its condition (the lease is another's, or gone); CheckpointUnavailable
        (redacted) for any other failure."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _REFUSED or status in _REFUSED:
                return None
            raise CheckpointUnavailable(redact_message(f"{what} {self.uri} failed: {type(exc).__name__}: {exc}")) from None
        except (BotoCoreError, ConnectionError, TimeoutError) as exc:
            raise CheckpointUnavailable(redact_message(f"{what} {self.uri} failed: {type(exc).__name__}: {exc}; check "
                                                       "AWS_ENDPOINT_URL and the credentials")) from None

    def _put(self, **condition: str) -> str | None:
        """Write this run's lease under `condition` (IfNoneMatch or IfMatch); its ETag, None when refused."""
        body = self._body()
        answer = self._s3("writing the lease", lambda: self.store.s3.put_object(
            Bucket=self.store.bucket, Key=self.key, Body=body, ContentType="application/json", **condition))
        return None if answer is None else answer["ETag"]

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(the lease as stored, its ETag); (None, None) when there is none. One that is not a JSON object (no
        posttrain run wrote it) reads as a lease without a holder that has expired."""
        answer = self._s3("reading the lease", lambda: self.store.s3.get_object(Bucket=self.store.bucket, Key=self.key))
        if answer is None:
            return None, None
        raw = answer["Body"].read(65536)
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        return (data if isinstance(data, dict) else {"owner": None, "expires": 0}), answer["ETag"]

    # ------------------------------------------------------------------------------------------------- the API

    def acquire(self, lock_note: str = "") -> S3Lease:
        """Hold the lease, or raise LeaseHeld naming its holder. `lock_note`: what the run lock file said before this
        process took the lock (a holder whose owner id it names is gone)."""
        for _ in range(5):  # a lease released or taken between two calls: look again
            etag = self._put(IfNoneMatch="*")
            current, current_etag = self.read()
            if current is not None and current.get("owner") == self.owner:  # ours (also: a retried put that had won)
                self._etag = current_etag or etag
                self._start()
                return self
            if current is None:
                continue
            expires = current.get("expires")
            stale = isinstance(expires, (int, float)) and expires < time.time()
            gone = bool(current.get("owner")) and str(current["owner"]) in lock_note
            if not (stale or gone):
                raise LeaseHeld(
                    f"the S3 prefix {self.store.remote_uri} is leased to another run: {holder(current)}. Two runs "
                    f"writing one prefix would prune each other's checkpoints. Wait for that run to end (or, if it is "
                    f"gone, for its lease to expire: {self.lease_s:g} s after its last renewal; then this run takes "
                    f"it over), or pick another job.name or tracking.checkpoint_uri; the lease is {self.uri}")
            log.warning("taking over the lease of %s from %s: %s", self.store.remote_uri, holder(current),
                        "it expired" if stale else "its holder held this run's lock, which this process now holds")
            self._put(IfMatch=current_etag)  # of two takers one wins; the loop reads who
        raise LeaseHeld(f"the lease {self.uri} changed hands five times while this run tried to take it; another "
                        "run is starting on this prefix: wait for it, or pick another job.name")

    def _start(self) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="s3-lease", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                etag = self._put(IfMatch=self._etag)
            except CheckpointUnavailable as exc:  # S3 out of reach: the next renewal tries again
                log.warning("renewing the lease %s failed (%s); retrying in %g s", self.uri, exc, self.renew_s)
                continue
            if etag is not None:
                self._etag = etag
                continue
            try:
                current, _ = self.read()
            except CheckpointUnavailable:
                current = None
            if current is None and self._recreate():
                continue
            self._lost = (f"this run's lease on {self.store.remote_uri} was taken over by "
                          f"{holder(current) if current else 'another run (it is gone again)'}: this run stalled or "
                          f"could not reach S3 for longer than {self.lease_s:g} s; it writes nothing more there")
            log.error("%s", self._lost)
            return

    def _recreate(self) -> bool:
        """The lease is gone (S3 lost it, or someone deleted it) and nobody took it: write it again, as a new lease
        (`If-None-Match`, so a run that took the prefix meanwhile keeps it). Whether this run holds it again."""
        try:
            etag = self._put(IfNoneMatch="*")
            current, current_etag = self.read()
        except CheckpointUnavailable:
            return False
        if etag is None or current is None or current.get("owner") != self.owner:
            return False
        self._etag = current_etag or etag
        log.warning("the lease %s was gone (S3 lost it, or it was deleted) and no other run held the prefix: this "
                    "run wrote it again", self.uri)
        return True

    def check(self) -> None:
        """Raise LeaseLost when this run's lease was taken over (see the module notes)."""
        if self._lost is not None:
            raise LeaseLost(self._lost)

    @property
    def held(self) -> bool:
        return self._etag is not None and self._lost is None

    def release(self) -> None:
        """Stop renewing and delete the lease when it is still this run's. A failure is a warning: the lease then
        expires by itself."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
            self._renewer = None
        if self._etag is None or self._lost is not None:
            return
        self._etag = None
        try:
            current, _ = self.read()
            if current is not None and current.get("owner") == self.owner:
                self._s3("releasing the lease", lambda: self.store.s3.delete_object(
                    Bucket=self.store.bucket, Key=self.key))
        except CheckpointUnavailable as exc:
            log.warning("the lease %s was not released (%s); it expires %g s after its last renewal", self.uri, exc,
                        self.lease_s)
