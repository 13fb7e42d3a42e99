"""Counters shared by the engine thread and the I/O loop.

Increments come from two threads (the engine's and ec-s3's loop), so they take a
lock; it is uncontended in practice and costs well under a microsecond. ``snapshot``
is what metrics, logs and tests read.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["Counters"]


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}

    def inc(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._values[name] += value

    def set_gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, self._gauges.get(name, 0.0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self._values, **self._gauges}

    def __repr__(self) -> str:
        return f"Counters({dict(sorted(self.snapshot().items()))})"
