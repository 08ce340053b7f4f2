"""Which object-store failures are worth retrying, and the backoff schedule (pure, no I/O).

Transient: the server is down or restarting (connection refused/reset, timeouts), overloaded (5xx,
SlowDown). Permanent: everything the user has to fix (credentials, bucket, permissions) — retrying
those only hides the cause, so they surface at once as a KilnError.
"""

from __future__ import annotations

import errno
import http.client
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kiln.errors import KilnError, Unavailable

log = logging.getLogger("kiln.storage")

T = TypeVar("T")

# S3 error codes that a retry can fix (the server said "not now", not "no").
TRANSIENT_S3_CODES = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "OperationAborted"}
)
# S3 error codes that name a user mistake; the message says what to fix.
PERMANENT_S3_CODES = {
    "InvalidAccessKeyId": "the access key is not known to the server (check AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (check AWS_SECRET_ACCESS_KEY)",
    "AccessDenied": "the credentials are not allowed to do this (check the bucket policy)",
    "NoSuchBucket": "the bucket does not exist (create it, or fix checkpoint.uri)",
    "InvalidBucketName": "the bucket name is not valid",
}


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by a total time budget."""

    initial_s: float = 0.2
    max_delay_s: float = 10.0
    budget_s: float = 300.0  # give up after this long without success (a restarting server has time)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number `attempt` (0-based): uniform in [cap/2, cap], cap doubling."""
        cap = min(self.max_delay_s, self.initial_s * (2**attempt))
        return cap * (0.5 + 0.5 * (rng or random).random())


def is_transient(err: BaseException) -> bool:
    """True for failures a retry can fix: the network or the server, not the request."""
    if _is_tls_failure(err):
        return False  # a certificate problem does not heal by waiting
    code = getattr(err, "code", None)
    if isinstance(code, str) and code in TRANSIENT_S3_CODES:
        return True
    if type(err).__name__ == "ServerError":  # minio: an HTTP 5xx without an S3 error body
        return True
    status = getattr(err, "status", None) or getattr(getattr(err, "response", None), "status", None)
    if isinstance(status, int) and status >= 500:
        return True
    if isinstance(err, (ConnectionError, TimeoutError, socket.timeout, http.client.HTTPException)):
        return True
    if isinstance(err, OSError) and err.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE):
        return True
    # urllib3 wraps the socket error (MaxRetryError, ProtocolError, NewConnectionError, ReadTimeoutError).
    mod = type(err).__module__ or ""
    if mod.startswith("urllib3"):
        return True
    return False


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    classify: Callable[[BaseException], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `fn`, retrying transient failures with backoff; `classify` may raise a KilnError for permanent ones."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - classified below
            if classify is not None:
                classify(err)  # raises a KilnError for a permanent failure
            if not is_transient(err):
                raise
            elapsed = time.monotonic() - start
            wait = policy.delay(attempt)
            if elapsed + wait > policy.budget_s:
                raise Unavailable(
                    f"{what}: still failing after {attempt + 1} attempts over {elapsed:.0f}s "
                    f"({type(err).__name__}: {_short(err)}); is the server up and reachable?"
                ) from err
            log.warning(
                "%s failed (%s: %s); retry %d in %.1fs (giving up after %.0fs)",
                what,
                type(err).__name__,
                _short(err),
                attempt + 1,
                wait,
                policy.budget_s,
            )
            sleep(wait)
            attempt += 1


def _is_tls_failure(err: BaseException | None) -> bool:
    seen = 0
    while err is not None and seen < 5:  # urllib3 wraps the ssl error (MaxRetryError.reason, __cause__)
        if isinstance(err, ssl.SSLError) or type(err).__name__ == "SSLError":
            return True
        err = getattr(err, "reason", None) or err.__cause__
        seen += 1
    return False


def _short(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return text[:200]
