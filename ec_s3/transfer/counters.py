"""Counters, gauges and latency samples shared by the engine thread and the I/O loop.

Increments from both threads take an uncontended lock. ``snapshot`` is for tests and
logs; ``take_delta`` is what vLLM's stats hooks ship. Every increment reaches exactly one
reader: other counters of the process are a :class:`DeltaSource` that
:meth:`Counters.pull` folds in. Owns the counting, not what the names mean
(:mod:`ec_s3.connector.metrics`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Protocol

__all__ = ["Counters", "DeltaSource"]

#: Latency samples kept per histogram between two stats collections (and when
#: merged); vLLM ships stats every step, so this only bounds memory if nobody collects.
MAX_SAMPLES = 4096


class DeltaSource(Protocol):
    def take_delta(self) -> dict[str, float]:
        """Increments since the last call, each handed out once."""
        ...


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._samples: defaultdict[str, list[float]] = defaultdict(list)

    def inc(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._values[name] += value

    def pull(self, source: DeltaSource) -> None:
        """Fold ``source``'s increments since anyone last took them into these counters."""
        delta = source.take_delta()
        if delta:
            with self._lock:
                for name, value in delta.items():
                    self._values[name] += value

    def set_gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def observe(self, name: str, seconds: float) -> None:
        """Record a latency sample (for histograms) and count its sum."""
        with self._lock:
            self._values[name] += seconds
            samples = self._samples[name]
            if len(samples) < MAX_SAMPLES:
                samples.append(seconds)

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, self._gauges.get(name, 0.0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self._values, **self._gauges}

    def take_delta(self) -> dict[str, Any]:
        """Counter increments and samples since the last call, plus current gauges."""
        with self._lock:
            counters = {}
            for name, value in self._values.items():
                delta = value - self._reported.get(name, 0.0)
                if delta:
                    counters[name] = delta
                    self._reported[name] = value
            samples = {k: v for k, v in self._samples.items() if v}
            self._samples = defaultdict(list)
            return {"counters": counters, "gauges": dict(self._gauges), "samples": samples}

    def cumulative(self) -> dict[str, float]:
        """Every counter's running total (what :mod:`ec_s3.transfer.shared_stats` mirrors)."""
        with self._lock:
            return dict(self._values)

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return dict(self._gauges)

    def take_samples(self) -> dict[str, list[float]]:
        """Latency samples since the last call (the counterpart of :meth:`take_delta`'s)."""
        with self._lock:
            samples = {k: v for k, v in self._samples.items() if v}
            self._samples = defaultdict(list)
            return samples

    def __repr__(self) -> str:
        return f"Counters({dict(sorted(self.snapshot().items()))})"
