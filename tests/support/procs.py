"""Processes as a test sees them: whether a pid is alive (a zombie is not: it has
exited and only waits to be reaped), and waiting until a condition holds. Owns no
process; the sandbox starts and stops them (:mod:`ec_s3.sandbox.procgroup`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["alive", "still_alive_after", "wait_until"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def still_alive_after(pids: Iterable[int], timeout: float) -> list[int]:
    """The pids still alive once they all went or ``timeout`` passed."""
    pids = list(pids)
    wait_until(lambda: not any(alive(p) for p in pids), timeout)
    return [p for p in pids if alive(p)]
