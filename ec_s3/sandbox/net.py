"""Loopback networking for the local servers: a free port, and a GET that never raises.

Owns how a sandbox picks a port and probes an HTTP endpoint (health checks, metric
scrapes, waiting for a freshly started server to answer). Does not own serving anything.
"""

from __future__ import annotations

import http.client
import socket
import time
import urllib.error
from collections.abc import Callable
import urllib.request

__all__ = ["LOOPBACK", "free_port", "http_get", "wait_answering"]

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


def wait_answering(port: int, exit_status: Callable[[], int | None], timeout_s: float, label: str) -> str | None:
    """Poll ``GET /`` on a loopback port until anything answers HTTP (any status: S3
    servers answer 403 without credentials). None once it does, else why it never will:
    the process exited (``exit_status()`` not None) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = exit_status()
        if code is not None:
            return f"{label} exited with status {code}"
        conn = http.client.HTTPConnection(LOOPBACK, port, timeout=1.0)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return None
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            return f"port {port} not answering after {timeout_s:.0f} s"
        time.sleep(0.05)
