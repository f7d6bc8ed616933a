"""S3 for checkpoints: which errors are transient (retried within a time budget) and which name a fix, and
the URI helpers. Every message goes through `rl_core.redact`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from urllib.parse import urlparse

from rl_core.redact import has_userinfo, redact_message, redact_uri

# Total time (seconds) a transient S3 failure of one call is retried for: a shared S3 outage or an
# endpoint restart (~30 s) is ridden out instead of stopping training.
S3_RETRY_BUDGET_S = 120.0
RETRY_BUDGET_ENV = "POSTTRAIN_S3_RETRY_BUDGET_S"
# Jitter has its own generator: the global `random` stream belongs to the training run (checkpointed).
JITTER = random.Random()


# ------------------------------------------------------------------------------ S3 error classes

# ClientError codes worth retrying (throttling, timeouts, server-side trouble); any HTTP 5xx or 429 too.
TRANSIENT_S3_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "InternalServerError", "ServiceUnavailable",
    "ServiceUnavailableException", "PriorRequestNotComplete", "OperationAborted", "500", "502", "503", "504",
})
# What to fix, for the non-transient errors a misconfiguration produces.
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
}


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


def is_transient_s3_error(exc: BaseException) -> bool:
    """True for errors a retry can cure: connection errors, timeouts, HTTP 5xx/429, throttling
    (SlowDown, ...), RequestTimeout. False for invalid requests (ParamValidationError), missing
    credentials, NoSuchBucket, AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch, other 4xx."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    for err in _error_chain(exc):
        if isinstance(err, ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return code in TRANSIENT_S3_CODES or status >= 500 or status == 429
        if isinstance(err, (BotoConnectionError, HTTPClientError, IncompleteReadError, ConnectionError,
                            TimeoutError)):
            return True
    return False


def s3_error_fix(exc: BaseException) -> str:
    """What to fix for a non-transient S3 error, in words."""
    from botocore.exceptions import (
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
        PartialCredentialsError,
    )

    refused = client_error(exc)
    if refused is not None:
        code = str(refused.response.get("Error", {}).get("Code", ""))
        return _FIXES.get(code, f"S3 refused the request ({code or 'no error code'}): check "
                                f"tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials")
    for err in _error_chain(exc):
        if isinstance(err, ParamValidationError):
            return ("the request is invalid before it reaches S3: fix tracking.checkpoint_uri "
                    "(s3://bucket/prefix, a valid bucket name)")
        if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
            return "no usable AWS credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        if isinstance(err, NoRegionError):
            return "no AWS region: set AWS_DEFAULT_REGION (or AWS_PROFILE's region)"
    return "check tracking.checkpoint_uri, AWS_ENDPOINT_URL and the credentials in the environment"


def budget_from_env() -> float:
    raw = os.environ.get(RETRY_BUDGET_ENV, "").strip()
    if not raw:
        return S3_RETRY_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{RETRY_BUDGET_ENV}={raw!r}: expected seconds, e.g. {S3_RETRY_BUDGET_S:g}") from None
    if not value >= 0:
        raise ValueError(f"{RETRY_BUDGET_ENV}={raw!r}: must be >= 0 seconds")
    return value


class S3Failure(Exception):
    """An S3 call that failed for good; `missing`: the object does not exist (NoSuchKey / 404), as opposed to
    an endpoint, credential or bucket problem."""

    def __init__(self, what: str, attempts: int, reason: str, note: str = "", missing: bool = False):
        self.missing = missing
        tries = f"after {attempts} attempt{'s' if attempts > 1 else ''}"
        super().__init__(redact_message(f"{what}: {reason} ({tries}{'; ' + note if note else ''})"))


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
