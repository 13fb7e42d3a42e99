"""Typed errors of the S3 store and the one mapping from transport exceptions to them.

Owns the :class:`StoreError` tree, whose instances carry what failed (``op``, ``key``)
and why (``status``, the HTTP status; ``code``, the S3 error code; ``message``) as
fields, :func:`from_status` (an answer's status and S3 code to its type) and
:func:`to_store_error`, the only place in ec-s3 that looks at botocore,
aiohttp, asyncio or OS exception types. Callers branch on the class and on those
fields, never on text. Does not own retrying or the circuit breaker
(:mod:`ec_s3.store.client`, :mod:`ec_s3.store.breaker`) nor the wording for an operator
(:mod:`ec_s3.store.diagnose`).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from typing import Any, ClassVar

import aiohttp
from botocore import exceptions as boto_exc

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "CABundleError",
    "CircuitOpen",
    "IntegrityError",
    "NoCredentials",
    "ObjectChanged",
    "ObjectNotFound",
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
    "from_status",
    "tls_error",
    "to_store_error",
]


class StoreError(Exception):
    """An S3 operation failed.

    ``status`` is the HTTP status when the server answered (None when it did not);
    ``code`` is the S3 error code of that answer (None when it carried none, as a
    HEAD's does); ``message`` is for people. ``transient`` says whether the same
    request may succeed later (retried, spooled, counted as an outage).
    """

    transient: ClassVar[bool] = False
    hint: ClassVar[str] = ""  # what to do, appended to str(); never secret

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
    """Throttling, 5xx, timeouts or connection errors outlasted the retry budget."""

    transient = True


class StoreTimeout(StoreUnavailable):
    """The server accepted the connection but did not answer within read_timeout_s."""


class StoreUnreachable(StoreUnavailable):
    """No connection to the endpoint: refused, no route, DNS failure, connect timeout,
    proxy failure, or no pooled connection free in time."""


class StoreBusy(StoreUnavailable):
    """Not sent: no request slot (``max_concurrency``) came free within
    ``request_timeout_s``; the slots are held by slow requests. Not retried (a retry
    would queue again) and not counted by the circuit breaker."""


class TLSError(StoreUnreachable):
    """The TLS handshake failed: a wrong scheme or port, or an untrusted certificate.

    Transient like any unreachable endpoint: from the connector's side a store it cannot
    talk TLS to is down (retries cost one handshake each; the breaker stops them)."""


class UntrustedCertificate(TLSError):
    """The handshake reached the certificate check and the certificate failed it: not
    signed by a trusted CA, expired, or not for this host name."""


class CircuitOpen(StoreUnavailable):
    """Not tried: the store failed repeatedly and the circuit breaker is open."""


class StoreClosed(StoreError):
    """The store was closed."""


class ObjectChanged(StoreError):
    """The object was replaced (or resized) between the ranges of one GET: a later
    range's ``If-Match`` got 412. Not transient: the caller encodes for itself."""


class IntegrityError(StoreError):
    """The object's bytes do not match the checksum its writer stored with it."""


_RETRYABLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
     "ServiceUnavailable", "RequestLimitExceeded", "ConditionalRequestConflict"}
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound"})
_DENIED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})

_CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = (
    boto_exc.NoCredentialsError,
    boto_exc.PartialCredentialsError,
    boto_exc.CredentialRetrievalError,
    boto_exc.UnknownCredentialError,
    boto_exc.NoAuthTokenError,
    boto_exc.TokenRetrievalError,
    boto_exc.SSOError,
    boto_exc.RefreshWithMFAUnsupportedError,
    boto_exc.MetadataRetrievalError,
    boto_exc.ProfileNotFound,
)
# ssl.SSLError is an OSError: it must be matched before the OSError of _BROKEN_ERRORS.
_TLS_ERRORS: tuple[type[BaseException], ...] = (boto_exc.SSLError, aiohttp.ClientSSLError, ssl.SSLError)
# The certificate check itself failed (not, say, a plain-HTTP port answering a handshake).
_CERTIFICATE_ERRORS: tuple[type[BaseException], ...] = (ssl.SSLCertVerificationError, aiohttp.ClientConnectorCertificateError)
_UNREACHABLE_ERRORS: tuple[type[BaseException], ...] = (
    boto_exc.ConnectionError,  # botocore's: EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError
    aiohttp.ClientConnectorError,  # DNS, refused, no route (ClientProxyConnectionError is one)
    aiohttp.ClientHttpProxyError,
    aiohttp.ConnectionTimeoutError,  # connect, or waiting for a pooled connection
    ConnectionRefusedError,
    socket.gaierror,
)
_TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (boto_exc.ReadTimeoutError, asyncio.TimeoutError, TimeoutError)
_BROKEN_ERRORS: tuple[type[BaseException], ...] = (
    boto_exc.HTTPClientError,  # ConnectionClosedError, ResponseStreamingError
    boto_exc.IncompleteReadError,
    boto_exc.ChecksumError,
    boto_exc.FlexibleChecksumError,  # a body damaged in transit: a retry fetches it again
    boto_exc.CapacityNotAvailableError,
    aiohttp.ClientError,  # ServerDisconnectedError, ClientPayloadError, ClientOSError, ...
    OSError,  # resets, broken pipes: a socket error botocore did not wrap
)
_USERINFO = re.compile(r"//[^/@\s]+@")


def _clean(text: str) -> str:
    """Drop ``user:password@`` from any URL an exception quotes (proxy URLs may carry one)."""
    return _USERINFO.sub("//***@", text)


def _transport_message(exc: BaseException) -> str:
    text = _clean(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _from_client_error(op: str, key: str, exc: boto_exc.ClientError) -> StoreError:
    response = exc.response or {}
    error = response.get("Error", {}) or {}
    status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", 0) or 0) or None
    raw_code = str(error.get("Code", "") or "")
    # botocore fills Code with the status ("404") when the answer had no body (HEAD).
    code = raw_code if raw_code and not raw_code.isdigit() else None
    if status is None and raw_code.isdigit():
        status = int(raw_code)
    message = _clean(str(error.get("Message", "") or ""))
    return from_status(op, key, status, code, message)


def from_status(op: str, key: str, status: int | None, code: str | None, message: str = "") -> StoreError:
    """The typed error for an answer of the server: its HTTP ``status`` and the S3 error
    ``code`` of its body (None when it had none, as a HEAD's). The one place that decides
    which answers are missing objects, refusals, transient or the request's fault, for
    the botocore path and the direct one (:mod:`ec_s3.store.wire`) alike."""
    kw: dict[str, Any] = {"status": status, "code": code or None}
    if code == "NoSuchBucket":
        return BucketNotFound(op, key, message or "bucket does not exist", **kw)
    if status == 404 or code in _NOT_FOUND_CODES:
        return ObjectNotFound(op, key, message, **kw)
    if status in (401, 403) or code in _DENIED_CODES:
        return AccessDenied(op, key, message, **kw)
    if (status is not None and (status >= 500 or status == 429)) or code in _RETRYABLE_CODES:
        return StoreUnavailable(op, key, message, **kw)
    return StoreRequestError(op, key, message, **kw)


def tls_error(op: str, key: str, exc: BaseException, message: str) -> TLSError:
    """:class:`UntrustedCertificate` when the certificate check failed anywhere down the
    chain of ``exc`` (aiobotocore wraps aiohttp's error, which wraps ssl's), else
    :class:`TLSError`."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, _CERTIFICATE_ERRORS):
            return UntrustedCertificate(op, key, message)
        seen = seen.__cause__ or seen.__context__
    return TLSError(op, key, message)


def to_store_error(op: str, key: str, exc: BaseException) -> StoreError | None:
    """The typed error for an exception raised while talking to S3, or None when
    ``exc`` is not a store failure (a bug, or an error of the caller's own code, which
    must propagate unchanged). Order matters: the more specific classes come first."""
    if isinstance(exc, StoreError):
        return exc
    error: StoreError
    if isinstance(exc, boto_exc.ClientError):
        error = _from_client_error(op, key, exc)
    elif isinstance(exc, _CREDENTIAL_ERRORS):
        error = NoCredentials(op, key, _transport_message(exc))
    elif isinstance(exc, _TLS_ERRORS):
        error = tls_error(op, key, exc, _transport_message(exc))
    elif isinstance(exc, _UNREACHABLE_ERRORS):
        error = StoreUnreachable(op, key, _transport_message(exc))
    elif isinstance(exc, _TIMEOUT_ERRORS):
        error = StoreTimeout(op, key, _transport_message(exc))
    elif isinstance(exc, aiohttp.InvalidURL):
        error = StoreConfigError(op, key, _transport_message(exc))
    elif isinstance(exc, _BROKEN_ERRORS):
        error = StoreUnavailable(op, key, _transport_message(exc))
    elif isinstance(exc, boto_exc.BotoCoreError):
        error = StoreConfigError(op, key, _transport_message(exc))
    else:
        return None
    error.__cause__ = exc
    return error
