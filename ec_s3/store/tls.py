"""The CA a store trusts (:class:`Trust`) and the SSL contexts built from it.

botocore follows the AWS chain for a CA (``AWS_CA_BUNDLE``, the profile's
``ca_bundle``) only when ``create_client`` gets ``verify=None``, while the direct data
path (:mod:`.wire`, :mod:`.recv`) builds its own SSL context. So the store decides once
(:func:`ec_s3.store.connection.resolve_endpoint`) and hands both paths that one
:class:`Trust`: the client as ``verify=<file>`` (:func:`botocore_verify`), the direct
path as a context (:func:`ssl_context`), never each its own.

Owns: :class:`Trust`, the SSL contexts and the load check of the chosen file (a typed
:class:`~ec_s3.store.errors.CABundleError` naming where the path came from). Does not
own the choice (:mod:`.connection`), the client, nor the words of a failed handshake
(:mod:`.diagnose`).
"""

from __future__ import annotations

import dataclasses
import ssl

from botocore.httpsession import create_urllib3_context

from ec_s3.store.errors import CABundleError

__all__ = ["DEFAULT_CA_SOURCE", "Trust", "botocore_verify", "check_ca_file", "ssl_context"]

DEFAULT_CA_SOURCE = "default: certifi's public CAs"


@dataclasses.dataclass(frozen=True)
class Trust:
    """What a TLS handshake with the endpoint is checked against."""

    verify: bool
    ca_file: str | None  # the PEM file of trusted CAs; None when verify is False
    source: str  # where it came from, in words: "AWS_CA_BUNDLE", "profile 'x' (ca_bundle in ...)", ...

    @property
    def is_default(self) -> bool:
        return self.source == DEFAULT_CA_SOURCE


def check_ca_file(trust: Trust) -> None:
    """Fail now, typed and naming the source, when the chosen CA file cannot be loaded:
    botocore would raise a bare OSError at the first request, which reads as an
    unreachable endpoint and is retried."""
    if trust.verify and not trust.is_default:
        ssl_context(trust)


def ssl_context(trust: Trust) -> ssl.SSLContext:
    """A client context that verifies against ``trust`` (built as aiobotocore builds its
    own), or with ``verify_tls: false`` one that checks neither certificate nor host
    name (as aiohttp's ``ssl=False`` and botocore's ``verify=False``)."""
    if not trust.verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    context = create_urllib3_context()
    try:
        context.load_verify_locations(trust.ca_file)
    except (OSError, ssl.SSLError) as exc:
        why = exc.strerror or type(exc).__name__
        raise CABundleError("connect", "", f"the CA bundle {trust.ca_file} (from {trust.source}) cannot be loaded: {why}") from exc
    return context


def botocore_verify(trust: Trust) -> bool | str:
    """``create_client``'s ``verify``: the file itself, so botocore does not resolve again."""
    return trust.ca_file if trust.verify and trust.ca_file else False
