"""Loopback networking for the local servers: a free port, and a GET that never raises.

Owns how a sandbox picks a port and probes an HTTP endpoint (health checks, metric
scrapes). Does not own serving anything, nor retries: a caller polls.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

__all__ = ["LOOPBACK", "free_port", "http_get"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (another process may still take it
    before the caller binds it: callers that cannot retry hold the socket instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback/user URL
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read() if exc.fp is not None else b""
    except (OSError, ValueError):  # URLError, connection refused/reset, timeouts
        return 0, b""
