"""SigV4 headers for the blob requests (:mod:`.wire`): S3's signature with ``UNSIGNED-PAYLOAD``,
written out, byte for byte what botocore's ``S3SigV4Auth`` with payload signing off
produces (tests/store/test_store_sigv4.py compares the two).

Owns the canonical request, the string to sign and the signing-key cache. Does not own
credentials or their refresh (:mod:`.wire` passes frozen ones), URLs (:func:`.wire.object_url`)
or which headers a request carries.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["UNSIGNED_PAYLOAD", "signed_headers"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
# Never signed (botocore's SIGNED_HEADERS_BLACKLIST): proxies and clients may change them.
_UNSIGNED = frozenset(("expect", "transfer-encoding", "user-agent", "x-amzn-trace-id"))
# Set here, replacing any the caller gave (as botocore does).
_REPLACED = frozenset(("authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256"))
_DEFAULT_PORTS = {"http": 80, "https": 443}


@functools.lru_cache(maxsize=16)
def _signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = hmac.digest(f"AWS4{secret}".encode(), date.encode(), "sha256")
    for part in (region, service, "aws4_request"):
        key = hmac.digest(key, part.encode(), "sha256")
    return key


def _host(url: str) -> str:
    """The Host botocore signs when the request names none: lowercase, without a default
    port or userinfo, an IPv6 address in brackets."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _canonical_query(query: str) -> str:
    if not query:
        return ""
    pairs = sorted(pair.partition("=")[::2] for pair in query.split("&"))
    return "&".join(f"{k}={v}" for k, v in pairs)


def signed_headers(
    method: str, url: str, headers: Mapping[str, str], *, access_key: str, secret_key: str,
    token: str | None, region: str, service: str = "s3", now: datetime.datetime | None = None,
) -> dict[str, str]:
    """``headers`` plus ``X-Amz-Date``, ``X-Amz-Content-SHA256: UNSIGNED-PAYLOAD``,
    ``X-Amz-Security-Token`` (with a session token) and ``Authorization`` for a request
    of ``method`` to ``url`` (its path and query already encoded, as sent). A ``Date``
    header is refused: botocore would sign it in place of ``X-Amz-Date``, and no
    request of ours carries one."""
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    out = {k: v for k, v in headers.items() if k.lower() not in _REPLACED}
    if any(k.lower() == "date" for k in out):
        raise ValueError("signed_headers: a Date header is not supported (X-Amz-Date is set)")
    out["X-Amz-Date"] = stamp
    if token:
        out["X-Amz-Security-Token"] = token
    out["X-Amz-Content-SHA256"] = UNSIGNED_PAYLOAD
    signed: dict[str, str] = {}
    for name, value in out.items():
        lname = name.lower()
        if lname not in _UNSIGNED:
            # One name twice (two spellings) is signed comma-joined, as botocore's get_all.
            value = " ".join(str(value).split())
            signed[lname] = f"{signed[lname]},{value}" if lname in signed else value
    signed.setdefault("host", _host(url))
    names = sorted(signed)
    parts = urlsplit(url)
    canonical = "\n".join((
        method.upper(), parts.path, _canonical_query(parts.query),
        "".join(f"{n}:{signed[n]}\n" for n in names), ";".join(names), UNSIGNED_PAYLOAD,
    ))
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    signature = hmac.new(_signing_key(secret_key, stamp[:8], region, service), to_sign.encode(),
                         hashlib.sha256).hexdigest()
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out
