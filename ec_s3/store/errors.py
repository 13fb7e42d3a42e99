"""The S3 store's plain result types: the :class:`StoreError` tree and :class:`PutOutcome`.

Owns the error classes, each with what failed (``op``, ``key``), why (``status``, ``code``,
``message``) and whether the same request may succeed later (``transient``); standard library
only. Does not own which answer or exception becomes which error (:mod:`ec_s3.store.error_map`),
retrying or the circuit breaker (:mod:`ec_s3.store.client`, :mod:`ec_s3.store.breaker`) nor the
wording for an operator (:mod:`ec_s3.store.diagnose`).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "CABundleError",
    "CertificateNameMismatch",
    "CircuitOpen",
    "CredentialsTimeout",
    "IntegrityError",
    "NoCredentials",
    "ObjectChanged",
    "ObjectNotFound",
    "PutOutcome",
    "StoreClosed",
    "StoreConfigError",
    "StoreBusy",
    "StoreError",
    "StoreRequestError",
    "StoreTimeout",
    "StoreUnavailable",
    "StoreUnreachable",
    "TLSError",
    "UntrustedCertificate",
]


class PutOutcome(enum.Enum):
    """How a PUT that did not fail ended."""

    CREATED = "created"  # this write stored it (also when its answer was lost: StoreStats.lost_answer_writes)
    ALREADY_EXISTS = "already_exists"  # 412 on a conditional put: another write stored it first


class StoreError(Exception):
    """An S3 operation failed.

    ``status`` is the HTTP status when the server answered (None when it did not);
    ``code`` is the S3 error code of that answer (None when it carried none, as a
    HEAD's does); ``message`` is for people. ``transient`` says whether the same
    request may succeed later (retried, spooled, counted as an outage).
    """

    transient: ClassVar[bool] = False
    hint: ClassVar[str] = ""  # what to do, appended to str(); never secret
    # The wait a transient answer asked for (its Retry-After), in seconds; None if none.
    retry_after_s: float | None = None

    def __init__(
        self, op: str, key: str, message: str = "", *, status: int | None = None, code: str | None = None
    ) -> None:
        self.op, self.key, self.message, self.status, self.code = op, key, message, status, code
        super().__init__(self._text())

    @property
    def reason(self) -> str:
        """Status, code and message in one line, for logs and reports only: branch on the fields."""
        head = " ".join(str(p) for p in (self.status, self.code) if p is not None)
        return f"{head}: {self.message}" if head and self.message else head or self.message

    def _text(self) -> str:
        text = f"S3 {self.op} {self.key!r} failed: {self.reason}"
        return f"{text} ({self.hint})" if self.hint else text

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields across pickling (process pools)
        return (_rebuild, (type(self), self.op, self.key, self.message, self.status, self.code))


def _rebuild(cls: type[StoreError], op: str, key: str, message: str, status: int | None, code: str | None) -> StoreError:
    return cls(op, key, message, status=status, code=code)


class ObjectNotFound(StoreError):
    """The key does not exist (404). A normal answer, not a fault."""


class AccessDenied(StoreError):
    """401/403: credentials or bucket policy refuse this operation. Never retried."""

    hint = "check the credentials and the bucket policy"


class NoCredentials(StoreError):
    """No usable credentials: none found, partial, or their source (profile, SSO, instance
    role) failed. Raised before any request leaves; never retried."""

    hint = "set access_key_id/secret_access_key, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"


class CredentialsTimeout(NoCredentials):
    """The credential source (a profile's ``credential_process``, SSO, an instance role)
    did not answer within ``request_timeout_s`` while the store created its client.
    Remembered for ``breaker_cooldown_s``: requests until then fail at once."""

    hint = "make the credential source answer faster, raise request_timeout_s, or set access_key_id/secret_access_key"


class StoreRequestError(StoreError):
    """Any other 4xx: the request itself is wrong. Never retried."""


class BucketNotFound(StoreRequestError):
    """The bucket does not exist (404 NoSuchBucket)."""


class StoreConfigError(StoreRequestError):
    """The client could not build the request (endpoint URL, region, addressing style or
    parameters botocore rejects). Nothing was sent; never retried."""


class CABundleError(StoreConfigError):
    """The CA bundle to trust (the ``ca_bundle`` key, ``AWS_CA_BUNDLE``, the profile's)
    cannot be read or holds no certificate. Nothing was sent; never retried."""


class StoreUnavailable(StoreError):
    """Throttling, 5xx, timeouts or connection errors outlasted the request's ``max_attempts``."""

    transient = True


class StoreTimeout(StoreUnavailable):
    """The server accepted the connection but did not answer within read_timeout_s."""


class StoreUnreachable(StoreUnavailable):
    """No connection to the endpoint: refused, no route, DNS failure, connect timeout,
    proxy failure, or no pooled connection free in time."""


class StoreBusy(StoreUnavailable):
    """Not sent: no request permit (``max_concurrency``) came free within
    ``request_timeout_s``; the permits are held by slow requests. Not retried (a retry
    would queue again) and not counted by the circuit breaker."""


class TLSError(StoreUnreachable):
    """The TLS handshake failed: a wrong scheme or port, or an untrusted certificate.

    Transient like any unreachable endpoint: from the connector's side a store it cannot
    talk TLS to is down (retries cost one handshake each; the breaker stops them)."""


class UntrustedCertificate(TLSError):
    """The handshake reached the certificate check and the certificate failed it: not
    signed by a trusted CA, expired, or not for this host name."""


class CertificateNameMismatch(UntrustedCertificate):
    """A certificate a trusted CA signed, but not for the endpoint's host (``host``, a DNS
    name or an IP address it does not list): another server, or one in the middle. Not
    transient: a retry meets the same certificate."""

    transient = False

    def __init__(
        self, op: str, key: str, message: str = "", *, status: int | None = None, code: str | None = None,
        host: str = "", port: int = 0,
    ) -> None:
        self.host, self.port = host, port  # where the certificate came from
        super().__init__(op, key, message, status=status, code=code)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_mismatch, (self.op, self.key, self.message, self.host, self.port))


def _rebuild_mismatch(op: str, key: str, message: str, host: str, port: int) -> CertificateNameMismatch:
    return CertificateNameMismatch(op, key, message, host=host, port=port)


class CircuitOpen(StoreUnavailable):
    """Not tried: the store failed repeatedly and the circuit breaker is open."""


class StoreClosed(StoreError):
    """The store was closed."""


class ObjectChanged(StoreError):
    """The object was replaced (or resized) between the ranges of one GET: a later
    range's ``If-Match`` got 412. Not transient: the caller encodes for itself."""


class IntegrityError(StoreError):
    """The object's bytes do not match the checksum its writer stored with it."""
