"""Prometheus ``/metrics`` of the local servers, read the way the demo and the tests
need them: sums of the series whose labels match, and ``None`` for a family that is
not exported (never a silent 0).

Owns one scrape and the sums over it; ``prometheus_client`` parses the text format. Does
not own which metrics exist (the connector's :mod:`ec_s3.connector.metrics`, vLLM, the
proxy) nor what a delta between two scrapes means (the callers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ec_s3.sandbox.net import http_get

__all__ = ["MetricSamples", "parse_prometheus", "scrape_metrics"]


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
    """Parse Prometheus text exposition with prometheus_client's parser (label escapes,
    ``NaN``/``+Inf``, timestamps); a malformed line raises :class:`ValueError`."""
    out = tuple(
        (sample.name, tuple(sorted(sample.labels.items())), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    )
    return MetricSamples(out, ok=True)


def scrape_metrics(url: str, timeout: float = 5.0) -> MetricSamples:
    """GET a ``/metrics`` URL; an empty :class:`MetricSamples` (``ok=False``) if it fails."""
    status, body = http_get(url, timeout)
    if status != 200:
        return MetricSamples()
    return parse_prometheus(body.decode("utf-8", "replace"))
