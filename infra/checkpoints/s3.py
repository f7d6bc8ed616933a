"""S3 for checkpoints: the boto3 client (botocore's adaptive retries, the timeouts of `tracking.s3`), the SHA256
checksums S3 stores and checks, what a failed call means (damage to an object, or what to fix), and the URI helpers.
Every message goes through `rl_core.redact`.

Retries are botocore's own: one request is tried up to `tracking.s3.max_attempts` times in `adaptive` mode
(connection errors, timeouts, HTTP 5xx, throttling; exponential backoff with jitter; a throttled client slows
down). Nothing here retries a call: a call that still fails is an `S3Failure`, naming the object and the fix.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from rl_core.config.schema import S3Config
from rl_core.redact import has_userinfo, redact_message, redact_uri

log = logging.getLogger("posttrain.storage")
CHECKSUM = "SHA256"  # the ChecksumAlgorithm of every upload: S3 checks the bytes against it and stores it
# Error codes that say one object is lost or not the bytes that were sent: damage to that object, not to the store.
DAMAGE_CODES = frozenset({"NoSuchKey", "404", "BadDigest"})
# What to fix, for the errors a misconfiguration produces (botocore does not retry them).
_FIXES = {
    "NoSuchBucket": "the bucket does not exist at this endpoint: create it, or fix the bucket in "
                    "tracking.checkpoint_uri (and AWS_ENDPOINT_URL)",
    "InvalidBucketName": "fix the bucket name in tracking.checkpoint_uri",
    "AccessDenied": "the credentials may not use this bucket/prefix: check the bucket policy and the "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)",
    "AllAccessDisabled": "all access to this bucket is disabled: use another bucket in tracking.checkpoint_uri",
    "InvalidAccessKeyId": "the access key is unknown to this endpoint: fix AWS_ACCESS_KEY_ID (or AWS_PROFILE) "
                          "and AWS_ENDPOINT_URL",
    "SignatureDoesNotMatch": "the secret key does not match the access key: fix AWS_SECRET_ACCESS_KEY "
                             "(or AWS_PROFILE)",
    "ExpiredToken": "the session token expired: refresh the credentials (AWS_SESSION_TOKEN or AWS_PROFILE)",
    "NoSuchKey": "the object is missing: the remote checkpoint is incomplete; use another step",
    "404": "the object or bucket is missing: check tracking.checkpoint_uri",
    "403": "access refused: check the credentials and the bucket policy",
    "BadDigest": "S3 received other bytes than were sent (its SHA256 check failed): the transfer was corrupted",
}


# ------------------------------------------------------------------------------ the client

def s3_client(settings: S3Config, endpoint_url: str | None = None):
    """A boto3 S3 client whose requests botocore retries in `adaptive` mode up to `settings.max_attempts` tries
    (this config wins over AWS_MAX_ATTEMPTS / AWS_RETRY_MODE), with its timeouts, checksums computed on every
    upload and validated on every download that has one, and each failed try logged. Credentials: the
    environment / AWS profiles only (boto3's default chain); the endpoint: `endpoint_url`, else AWS_ENDPOINT_URL."""
    import boto3
    from botocore.config import Config

    # botocore's `max_attempts` counts the retries only; `total_max_attempts` counts the first try too, as
    # tracking.s3.max_attempts, AWS_MAX_ATTEMPTS and the AWS config file's max_attempts do
    config = Config(retries={"mode": "adaptive", "total_max_attempts": settings.max_attempts},
                    connect_timeout=settings.connect_timeout_s, read_timeout=settings.read_timeout_s,
                    request_checksum_calculation="when_supported", response_checksum_validation="when_supported")
    client = boto3.client("s3", endpoint_url=endpoint_url or None, config=config)
    client.meta.events.register("needs-retry.s3", _retry_logger(settings.max_attempts),
                                unique_id="posttrain-log-s3-retries")
    return client


def _retry_logger(max_attempts: int):
    def log_failed_try(attempts: int, response=None, caught_exception=None, operation=None, request_dict=None,
                       **_) -> None:
        """A `needs-retry` handler beside botocore's own: it logs a try that failed for a reason botocore
        retries (no answer, HTTP 5xx or 429) and returns None, so botocore alone decides whether to retry."""
        reason = None
        if caught_exception is not None:
            reason = f"{type(caught_exception).__name__}: {caught_exception}"
        elif response is not None and (response[0].status_code >= 500 or response[0].status_code == 429):
            reason = f"HTTP {response[0].status_code} {(response[1] or {}).get('Error', {}).get('Code', '')}".strip()
        if reason is not None:
            where = f"{getattr(operation, 'name', 'request')} {(request_dict or {}).get('url', '')}"
            log.warning("%s", redact_message(f"S3 {where}: try {attempts} of {max_attempts} failed ({reason})"))

    return log_failed_try


# ------------------------------------------------------------------------------ checksums

def sha256_b64(hexdigest: str) -> str:
    """S3's form of a SHA256 checksum (`ChecksumSHA256`): base64 of the raw digest."""
    return base64.b64encode(bytes.fromhex(hexdigest)).decode()


def expected_sha256(path: Path, size: int, sha256: str, transfer) -> tuple[str, int | None]:
    """`(ChecksumSHA256, parts)` S3 stores for the file `path` (`size` bytes, hex `sha256`) once `upload_file` has
    uploaded it with `transfer` (a boto3 TransferConfig) and ChecksumAlgorithm SHA256. One PUT: the file's SHA256,
    parts None (the file is not read). A multipart upload: the SHA256 of the parts' SHA256 digests, parts cut as
    s3transfer cuts them (S3 shows it as `<checksum>-<parts>`); the file is read once, and checked to still have
    `sha256` (raises ValueError when not)."""
    from s3transfer.utils import ChunksizeAdjuster

    if size < transfer.multipart_threshold:
        return sha256_b64(sha256), None
    part_size = ChunksizeAdjuster().adjust_chunksize(transfer.multipart_chunksize, size)
    whole, digests = hashlib.sha256(), []
    with open(path, "rb") as f:
        while True:
            part, left = hashlib.sha256(), part_size
            while left and (block := f.read(min(left, 1 << 20))):
                part.update(block)
                whole.update(block)
                left -= len(block)
            if left == part_size:
                break
            digests.append(part.digest())
    if whole.hexdigest() != sha256:
        raise ValueError(f"{path}: its sha256 {whole.hexdigest()} differs from the manifest's {sha256}; the local "
                         "checkpoint changed after it was written, so it is not uploaded")
    return base64.b64encode(hashlib.sha256(b"".join(digests)).digest()).decode(), len(digests)


def checksum_matches(stored: str | None, expected: str, parts: int | None) -> bool:
    """Whether S3's stored `ChecksumSHA256` is `expected` (of `parts` parts; None: one PUT). S3 writes a multipart
    checksum as `<checksum>-<parts>`; an endpoint that leaves off the suffix is compared on the checksum alone."""
    if not stored:
        return False
    digest, _, count = stored.partition("-")
    return digest == expected and (not count or (parts is not None and int(count) == parts))


# ------------------------------------------------------------------------------ failures

def _error_chain(exc: BaseException) -> Iterable[BaseException]:
    """`exc`, then what it wraps (boto3's S3UploadFailedError wraps a ClientError, RetriesExceededError its last
    error), outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "last_exception", None) or current.__cause__ or current.__context__


def client_error(exc: BaseException):
    from botocore.exceptions import ClientError

    return next((e for e in _error_chain(exc) if isinstance(e, ClientError)), None)


def error_code(exc: BaseException) -> str:
    error = client_error(exc)
    return str(error.response.get("Error", {}).get("Code", "")) if error is not None else ""


def is_checksum_failure(exc: BaseException) -> bool:
    """The bytes botocore received differ from S3's checksum of them (ChecksumMode)."""
    from botocore.exceptions import FlexibleChecksumError

    return any(isinstance(e, FlexibleChecksumError) for e in _error_chain(exc))


def s3_error_fix(exc: BaseException, max_attempts: int) -> str:
    """What a failed S3 call means and what to fix, in words; says whether botocore retried it."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import (
        HTTPClientError,
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
        PartialCredentialsError,
    )

    budget = f"tracking.s3.max_attempts={max_attempts}"
    refused = client_error(exc)
    if refused is not None:
        code = error_code(exc)
        tries = int(refused.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)) + 1
        if tries > 1:
            return (f"still failing after {tries} tries (botocore's adaptive retries, {budget}): check that the "
                    f"endpoint (AWS_ENDPOINT_URL) is healthy, or raise {budget.split('=')[0]}")
        return "not retried: " + _FIXES.get(code, f"S3 refused the request ({code or 'no error code'}): check "
                                                  f"tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials")
    for err in _error_chain(exc):
        if isinstance(err, ParamValidationError):
            return ("not retried: the request is invalid before it reaches S3: fix tracking.checkpoint_uri "
                    "(s3://bucket/prefix, a valid bucket name)")
        if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
            return "not retried: no usable AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        if isinstance(err, NoRegionError):
            return "not retried: no AWS region: set AWS_DEFAULT_REGION (or AWS_PROFILE's region)"
        if is_checksum_failure(err):
            return "the bytes received differ from S3's SHA256 checksum of the object: the object or the transfer is corrupt"
        if isinstance(err, (BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError)):
            return (f"no answer from the endpoint within {budget} tries (botocore's adaptive retries): check that "
                    f"the endpoint (AWS_ENDPOINT_URL) is up and reachable")
    return "check tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials in the environment"


class S3Failure(Exception):
    """An S3 call that failed for good (botocore's retries spent, or an error it does not retry). `damaged`: one
    object is missing (NoSuchKey / 404) or not the bytes it should be (a checksum disagrees), as opposed to an
    endpoint, credential or bucket problem."""

    def __init__(self, what: str, reason: str, note: str = "", damaged: bool = False):
        self.damaged = damaged
        super().__init__(redact_message(f"{what}: {reason}{f' ({note})' if note else ''}"))


def s3_failure(what: str, exc: BaseException, max_attempts: int) -> S3Failure:
    """The S3Failure for the exception `exc` of the call `what` (logged as a warning)."""
    reason = redact_message(f"{type(exc).__name__}: {exc}")
    failure = S3Failure(redact_message(what), reason, s3_error_fix(exc, max_attempts),
                        damaged=error_code(exc) in DAMAGE_CODES or is_checksum_failure(exc))
    log.warning("%s", failure)
    return failure


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if has_userinfo(uri) or "@" in urlparse(uri).netloc:
        raise ValueError(f"remote_uri={redact_uri(uri)!r}: credentials in the URI are refused; give them through "
                         f"the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) or an AWS profile (AWS_PROFILE)")
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"remote_uri={redact_uri(uri)!r}: expected s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")
