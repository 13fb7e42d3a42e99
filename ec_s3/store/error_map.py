"""Which failure becomes which typed store error: an answer's status and S3 code
(:func:`from_status`; a per-key error of DeleteObjects: :func:`from_delete_error`), and an
exception of the transport (:func:`to_store_error`, :func:`tls_error`).

The only place in ec-s3 that looks at botocore, aiohttp, asyncio or OS exception types (one
table, :data:`_TRANSPORT_ERRORS`). Does not own the error types (:mod:`ec_s3.store.errors`),
retrying (:mod:`ec_s3.store.client`) nor the wording for an operator (:mod:`ec_s3.store.diagnose`).
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from botocore import exceptions as boto_exc

from ec_s3.store.http1 import parse_retry_after
from ec_s3.store.errors import (
    AccessDenied,
    BucketNotFound,
    CertificateNameMismatch,
    NoCredentials,
    ObjectNotFound,
    StoreConfigError,
    StoreError,
    StoreRequestError,
    StoreTimeout,
    StoreUnavailable,
    StoreUnreachable,
    TLSError,
    UntrustedCertificate,
)

__all__ = ["from_delete_error", "from_status", "tls_error", "to_store_error"]

_TRANSIENT_CODES = frozenset(
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
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_NAME_MISMATCH = (62, 64)
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


def from_delete_error(entry: Mapping[str, Any]) -> StoreError:
    """The first per-key error of a DeleteObjects answer (itself a 200): a key refused
    with ``AccessDenied`` is a refusal like a 403 (its diagnosis names s3:DeleteObject)."""
    key, code, message = str(entry.get("Key", "")), entry.get("Code") or None, _clean(str(entry.get("Message", "")))
    if code == "AccessDenied":
        return from_status("DeleteObjects", key, 403, code, message)
    return StoreRequestError("DeleteObjects", key, message, code=code)


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
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    return from_status(op, key, status, code, message, retry_after=headers.get("retry-after"))


def from_status(
    op: str, key: str, status: int | None, code: str | None, message: str = "", *, retry_after: str | None = None
) -> StoreError:
    """The typed error for an answer of the server: its HTTP ``status`` and the S3 error
    ``code`` of its body (None when it had none, as a HEAD's). The one place that decides
    which answers are missing objects, refusals, transient or the request's fault, for
    the aiobotocore client's requests and :mod:`ec_s3.store.wire`'s alike. A transient
    one keeps the wait its ``Retry-After`` header asked for (``retry_after_s``)."""
    error = _from_status(op, key, status, code, message)
    if error.transient and retry_after is not None:
        error.retry_after_s = parse_retry_after(retry_after, time.time())
    return error


def _from_status(op: str, key: str, status: int | None, code: str | None, message: str) -> StoreError:
    kw: dict[str, Any] = {"status": status, "code": code or None}
    if code == "NoSuchBucket":
        return BucketNotFound(op, key, message or "bucket does not exist", **kw)
    if status == 404 or code in _NOT_FOUND_CODES:
        return ObjectNotFound(op, key, message, **kw)
    if status in (401, 403) or code in _DENIED_CODES:
        return AccessDenied(op, key, message, **kw)
    if (status is not None and (status >= 500 or status == 429)) or code in _TRANSIENT_CODES:
        return StoreUnavailable(op, key, message, **kw)
    return StoreRequestError(op, key, message, **kw)


def tls_error(op: str, key: str, exc: BaseException, message: str, *, host: str = "", port: int = 0) -> TLSError:
    """:class:`UntrustedCertificate` when the certificate check failed anywhere down the
    chain of ``exc`` (aiobotocore wraps aiohttp's error, which wraps ssl's), and
    :class:`CertificateNameMismatch` when what failed is its host name (connected to
    ``host:port``, or where aiohttp's error says); else :class:`TLSError`."""
    seen: BaseException | None = exc
    untrusted = False
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, aiohttp.ClientConnectorError):
            host, port = seen.host, seen.port or 0
        verify = getattr(seen, "certificate_error", seen)  # aiohttp's holds ssl's
        if isinstance(verify, ssl.SSLCertVerificationError) and verify.verify_code in _NAME_MISMATCH:
            return CertificateNameMismatch(op, key, message, host=host, port=port)
        untrusted = untrusted or isinstance(seen, _CERTIFICATE_ERRORS)
        seen = seen.__cause__ or seen.__context__
    return UntrustedCertificate(op, key, message) if untrusted else TLSError(op, key, message)


def _plain(kind: type[StoreError]) -> Callable[[str, str, BaseException], StoreError]:
    """A mapping to ``kind`` whose message names the transport exception."""
    return lambda op, key, exc: kind(op, key, _transport_message(exc))


# Transport exception families and what each becomes, tried top to bottom: the first
# family ``exc`` belongs to decides. A family must come before any wider one it is part
# of (an SSLError is an OSError; aiohttp's InvalidURL is a ClientError; every botocore
# exception is a BotoCoreError).
_TRANSPORT_ERRORS: tuple[tuple[tuple[type[BaseException], ...], Callable[[str, str, Any], StoreError]], ...] = (
    ((boto_exc.ClientError,), _from_client_error),  # the server answered
    (_CREDENTIAL_ERRORS, _plain(NoCredentials)),
    (_TLS_ERRORS, lambda op, key, exc: tls_error(op, key, exc, _transport_message(exc))),
    (_UNREACHABLE_ERRORS, _plain(StoreUnreachable)),
    (_TIMEOUT_ERRORS, _plain(StoreTimeout)),
    ((aiohttp.InvalidURL,), _plain(StoreConfigError)),
    (_BROKEN_ERRORS, _plain(StoreUnavailable)),
    ((boto_exc.BotoCoreError,), _plain(StoreConfigError)),  # the client could not build the request
)


def to_store_error(op: str, key: str, exc: BaseException) -> StoreError | None:
    """The typed error for an exception raised while talking to S3, or None when
    ``exc`` is not a store failure (a bug, or an error of the caller's own code, which
    must propagate unchanged)."""
    if isinstance(exc, StoreError):
        return exc
    for family, make in _TRANSPORT_ERRORS:
        if isinstance(exc, family):
            error = make(op, key, exc)
            error.__cause__ = exc
            return error
    return None
