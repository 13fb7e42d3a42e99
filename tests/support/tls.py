"""Real TLS for tests: a private CA, a server certificate it signs, and a TLS front.

Operators run S3 servers behind TLS signed by their own CA (MinIO, Ceph RGW on-prem);
the store must trust such a CA the AWS way (``AWS_CA_BUNDLE``, a profile's
``ca_bundle``) or through its ``ca_bundle`` key. These helpers let a test meet exactly
that: :func:`make_private_ca` writes a CA and a server certificate for
``127.0.0.1``/``localhost`` (with the ``cryptography`` package), and :class:`TLSFront`
terminates TLS on loopback and relays the plain bytes to any HTTP server (the
SeaweedFS fixture, a fault proxy), on an asyncio loop in a thread of its own.

The ``https_endpoint`` fixture of ``tests/conftest.py`` puts both in front of the
session's S3 server. Owns the certificates and the relay; not the S3 server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import ssl
import threading
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["HTTPSEndpoint", "PrivateCA", "TLSFront", "make_private_ca"]

_READ_SIZE = 1 << 18


@dataclasses.dataclass(frozen=True)
class PrivateCA:
    """PEM files: the CA's certificate (what a client trusts), and a server certificate
    it signed (SAN ``IP:127.0.0.1``, ``DNS:localhost``) with its key."""

    ca_path: Path
    cert_path: Path
    key_path: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_path, self.key_path)
        return context


def make_private_ca(directory: Path, name: str = "ec-s3 test CA",
                    server_names: tuple[str, ...] = ("IP:127.0.0.1", "DNS:localhost")) -> PrivateCA:
    """Write a fresh CA and a server certificate signed by it under ``directory``, for
    ``server_names`` (its subject alternative names: ``IP:...`` or ``DNS:...``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_names[0].partition(":")[2])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(v)) if k == "IP" else x509.DNSName(v)
             for k, _, v in (n.partition(":") for n in server_names)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = PrivateCA(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


class TLSFront:
    """``https://127.0.0.1:<port>`` in front of the plain-HTTP server ``upstream_url``:
    each TLS connection is relayed, byte for byte, over its own upstream connection
    (the ``Host`` header stays as the client signed it)."""

    def __init__(self, upstream_url: str, context: ssl.SSLContext) -> None:
        upstream = urlsplit(upstream_url)
        self._upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-front", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> TLSFront:
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self._context))
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            self._loop.close()
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> TLSFront:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(_READ_SIZE):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            ureader, uwriter = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(uwriter)
        await asyncio.gather(self._pipe(reader, uwriter), self._pipe(ureader, writer))

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        await asyncio.sleep(0.05)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclasses.dataclass(frozen=True)
class HTTPSEndpoint:
    """An S3 endpoint over TLS: its ``url`` and the CA file (``ca_path``) that makes a
    client trust it; nothing trusts it by default."""

    url: str
    ca_path: Path
    ca: PrivateCA
