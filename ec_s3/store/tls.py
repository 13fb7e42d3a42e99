"""The CA a store trusts (:class:`Trust`) and the SSL contexts built from it.

Owns :class:`Trust`, one per store (the aiobotocore client's ``verify=<file>``,
:func:`botocore_verify`; the blob pools' context, :func:`ssl_context`), the contexts (each
that verifies also checks the host name), the load check of the chosen file (a typed
:class:`~ec_s3.store.errors.CABundleError`) and :func:`certificate_names`. Does not own the
choice (:mod:`.connection`), the client, nor the words of a failed handshake (:mod:`.diagnose`).
"""

from __future__ import annotations

import dataclasses
import socket
import ssl

from botocore.httpsession import create_urllib3_context

from ec_s3.store.errors import CABundleError

__all__ = ["DEFAULT_CA_SOURCE", "Trust", "botocore_verify", "certificate_names", "check_ca_file", "ssl_context"]

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
    """A client context that verifies the certificate against ``trust`` and that it
    names the host connected to (a DNS name or an IP address, checked by OpenSSL as
    :func:`ssl.create_default_context`'s contexts do), or with ``verify_tls: false`` one
    that checks neither (as aiohttp's ``ssl=False`` and botocore's ``verify=False``)."""
    if not trust.verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    # urllib3's settings (aiobotocore's), but its check_hostname=False relies on urllib3
    # matching the name after the handshake, which aiohttp never does: any certificate
    # the CA signed, for any name, was accepted.
    context = create_urllib3_context()
    context.check_hostname = True
    try:
        context.load_verify_locations(trust.ca_file)
    except (OSError, ssl.SSLError) as exc:
        why = exc.strerror or type(exc).__name__
        raise CABundleError("connect", "", f"the CA bundle {trust.ca_file} (from {trust.source}) cannot be loaded: {why}") from exc
    return context


def certificate_names(host: str, port: int, trust: Trust, timeout_s: float) -> list[str] | None:
    """The names (``DNS:...``, ``IP Address:...``; else the subject's CN) in the
    certificate that ``host:port`` presents, its chain checked against ``trust`` but not
    its names; None when it cannot be read. Blocking: for a diagnosis, never the loop."""
    context = ssl_context(trust)
    context.check_hostname = False  # the question is which names it carries
    try:
        with socket.create_connection((host, port), timeout_s) as sock, \
                context.wrap_socket(sock, server_hostname=host) as tls:
            cert = tls.getpeercert() or {}
    except (OSError, ValueError, CABundleError):  # ssl.SSLError is an OSError
        return None
    names = [f"{kind}:{value}" for kind, value in cert.get("subjectAltName", ())]
    subject = [f"CN:{v}" for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    return names or subject


def botocore_verify(trust: Trust) -> bool | str:
    """``create_client``'s ``verify``: the file itself, so botocore does not resolve again."""
    return trust.ca_file if trust.verify and trust.ca_file else False
