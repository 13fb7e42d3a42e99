"""Prometheus ``/metrics`` of the local servers, read the way the demo and the tests
need them: sums of the series whose labels match, and ``None`` for a family that is
not exported (never a silent 0).

Owns parsing the text exposition format and one scrape. Does not own which metrics
exist (the connector's :mod:`ec_s3.connector.metrics`, vLLM, the proxy) nor what a
delta between two scrapes means (the callers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ec_s3.sandbox.net import http_get

__all__ = ["MetricSamples", "parse_prometheus", "scrape_metrics"]

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?\s*$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class MetricSamples:
    """Samples of one Prometheus scrape: ``get`` sums the series of a name whose labels
    include the given ones, and answers ``None`` when no such series exists (a metric
    family that is not exported, or a server that did not answer)."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...] = ()
    ok: bool = False
    by_name: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name, labels, value in self.samples:
            self.by_name.setdefault(name, []).append((dict(labels), value))

    def get(self, name: str, **labels: str) -> float | None:
        series = self.by_name.get(name)
        if not series:
            return None
        found = [v for ls, v in series if all(ls.get(k) == want for k, want in labels.items())]
        return sum(found) if found else None

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name


def parse_prometheus(text: str) -> MetricSamples:
    """Parse Prometheus text exposition (comments skipped, ``NaN``/``+Inf`` kept)."""
    out: list[tuple[str, tuple[tuple[str, str], ...], float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            continue
        name, label_text, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        labels = tuple(sorted(
            (k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            for k, v in _LABEL_RE.findall(label_text or "")
        ))
        out.append((name, labels, value))
    return MetricSamples(tuple(out), ok=True)


def scrape_metrics(url: str, timeout: float = 5.0) -> MetricSamples:
    """GET a ``/metrics`` URL; an empty :class:`MetricSamples` (``ok=False``) if it fails."""
    status, body = http_get(url, timeout)
    if status != 200:
        return MetricSamples()
    return parse_prometheus(body.decode("utf-8", "replace"))
