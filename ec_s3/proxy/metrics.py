"""The proxy's own counters and gauges, rendered as Prometheus text on ``/metrics``.

Owns the metric names, their types, labels and help texts, and this proxy's registry:
``prometheus_client`` metrics in a :class:`~prometheus_client.CollectorRegistry` of its own
(tests run several proxies in one process; the global registry would mix them). The
exposition and its escaping are ``prometheus_client``'s. It does not own when anything is
counted (the routes, the sends and the upstream pools do) nor vLLM's metrics (the upstreams serve
their own). Labels hold upstream URLs, never keys or request content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "SPECS", "MetricSpec", "ProxyMetrics"]

# What generate_latest writes (prometheus_client >= 0.22 names it CONTENT_TYPE_PLAIN_0_0_4;
# pyproject allows vLLM's floor, 0.18).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the proxy. ``mirrored``: its value is read from a table the proxy
    keeps anyway, at scrape time (:meth:`ProxyMetrics.mirror`), not counted here."""

    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[str, ...] = ()
    mirrored: bool = False


def _c(help_text: str, *labels: str, mirrored: bool = False) -> MetricSpec:
    return MetricSpec("counter", help_text, labels, mirrored)


def _g(help_text: str, *labels: str, mirrored: bool = False) -> MetricSpec:
    return MetricSpec("gauge", help_text, labels, mirrored)


# Names as queried (a counter's sample name, with its ``_total``), in exposition order.
SPECS: dict[str, MetricSpec] = {
    "ec_s3_proxy_requests_total": _c("Chat requests received, by whether they held media.", "kind"),
    "ec_s3_proxy_mm_items_total": _c("Media items seen in chat requests."),
    "ec_s3_proxy_metadata_only_items_total": _c(
        "Media items sent to prefill/decode as metadata-only parts (their blob in the bucket)."),
    "ec_s3_proxy_items_without_params_total": _c("Media items forwarded without encoder params."),
    "ec_s3_proxy_encoder_requests_total": _c("Encoder requests by upstream and outcome.", "upstream", "outcome"),
    "ec_s3_proxy_encoder_seconds_total": _c("Time spent in encoder requests.", "upstream"),
    "ec_s3_proxy_pd_responses_total": _c("PD answers relayed, by upstream and HTTP status.", "upstream", "status"),
    "ec_s3_proxy_pd_failures_total": _c("PD exchanges that failed below HTTP, by reason.", "upstream", "reason"),
    "ec_s3_proxy_pd_resends_total": _c(
        "PD requests cancelled and sent again without a failed encoder's pending marks."),
    "ec_s3_proxy_pd_retries_total": _c(
        "PD requests sent once more because vLLM's engine refused them before any token "
        "(finish_reason 'error', which vLLM calls retryable), by upstream.", "upstream", "reason"),
    "ec_s3_proxy_encoder_skips_total": _c(
        "Media items sent to prefill/decode as known to be in the bucket, with no encoder request, "
        "by how the proxy knew (answer: an encoder answered for it here; bucket: a HEAD).", "source"),
    "ec_s3_proxy_bucket_lookups_total": _c("The proxy's HEADs of items it did not know, by outcome.", "outcome"),
    "ec_s3_proxy_known_forgotten_total": _c(
        "Known items forgotten, by reason (missing: a consumer found no blob; expired; evicted).", "reason",
        mirrored=True),
    "ec_s3_proxy_known_entries": _g(
        "Items the proxy knows are in the bucket (bounded by known_max_entries).", mirrored=True),
    "ec_s3_proxy_client_disconnects_total": _c("Clients gone before their answer was relayed."),
    "ec_s3_proxy_rejected_total": _c("Chat requests answered 4xx/503 by the proxy itself, by reason.", "reason"),
    "ec_s3_proxy_internal_errors_total": _c("Requests that hit a bug in the proxy (answered 500)."),
    "ec_s3_proxy_requests_in_flight": _g("Chat requests being handled (bounded by max_in_flight)."),
    "ec_s3_proxy_in_flight": _g("Requests outstanding per upstream.", "role", "upstream"),
    "ec_s3_proxy_upstream_up": _g("0 while an upstream is skipped after refusing a connection.", "role", "upstream"),
    "ec_s3_proxy_route_picks_total": _c(
        "Requests routed by affinity (--route affinity), by outcome: affinity (the first rendezvous choice of the "
        "first media item), spill (it was over the load bound), no_media (least-loaded).", "role", "upstream", "outcome"),
}

# What a mirror reads: label values (in the spec's order) -> value.
MirrorRead = Callable[[], Mapping[tuple[str, ...], float]]


class _Mirror(Collector):
    """A family whose values live elsewhere, read at each scrape (prometheus_client's
    custom-collector pattern); empty until :meth:`ProxyMetrics.mirror` gives it a reader."""

    def __init__(self, name: str, spec: MetricSpec) -> None:
        self.name, self.spec = name, spec
        self.read: MirrorRead = dict

    def collect(self) -> Iterable[Metric]:
        family_type = CounterMetricFamily if self.spec.kind == "counter" else GaugeMetricFamily
        family = family_type(self.name, self.spec.help, labels=self.spec.labels)
        for values, value in self.read().items():
            family.add_metric(values, value)
        yield family


class _WithoutCreated(Collector):
    """The registry without the ``*_created`` samples prometheus_client adds to each
    counter: the proxy never exposed them, and each would be one more family to graph."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family


class ProxyMetrics:
    """This proxy's metrics; single-threaded use (one loop), as the server's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._live: dict[str, Counter | Gauge] = {}
        self._mirrors: dict[str, _Mirror] = {}
        for name, spec in SPECS.items():
            if spec.mirrored:
                self._mirrors[name] = mirror = _Mirror(name, spec)
                self.registry.register(mirror)
            else:
                kind = Counter if spec.kind == "counter" else Gauge
                self._live[name] = kind(name, spec.help, spec.labels, registry=self.registry)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` to a counter (or gauge); the labels must be the spec's, all of them."""
        self._series(name, labels).inc(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge (a counter cannot be set: prometheus_client has no such call)."""
        metric = self._series(name, labels)
        if not isinstance(metric, Gauge):
            raise TypeError(f"{name} is a {SPECS[name].kind}: only a gauge can be set")
        metric.set(value)

    def mirror(self, name: str, read: MirrorRead) -> None:
        """Serve ``name`` from ``read()`` at each scrape (a value the caller keeps anyway)."""
        self._mirrors[name].read = read

    def _series(self, name: str, labels: Mapping[str, str]) -> Counter | Gauge:
        metric = self._live.get(name)
        if metric is None:
            raise KeyError(f"{name!r} is not a counted proxy metric (see SPECS; mirrored ones are read, not set)")
        return metric.labels(**labels) if labels or SPECS[name].labels else metric

    def get(self, name: str, **labels: str) -> float:
        """Sum of every series of ``name`` whose labels include ``labels`` (0 if none)."""
        want = labels.items()
        return sum(s.value for family in self.registry.collect() for s in family.samples
                   if s.name == name and want <= s.labels.items())

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4: :data:`CONTENT_TYPE`)."""
        return generate_latest(_WithoutCreated(self.registry))
