"""The proxy's own counters and gauges, rendered as Prometheus text on ``/metrics``.

Owns the metric names, their help texts and the in-memory registry (one event loop, so
no locks). It does not own when anything is counted (the server and the upstream pools
do) nor vLLM's metrics (the upstreams serve their own). Labels hold upstream URLs, never
keys or request content.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    """Counters and gauges rendered as Prometheus text; single-threaded (one loop)."""

    _HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "ec_s3_proxy_requests_total": ("counter", "Chat requests received, by whether they held media."),
        "ec_s3_proxy_mm_items_total": ("counter", "Media items seen in chat requests."),
        "ec_s3_proxy_metadata_only_items_total": (
            "counter", "Media items sent to prefill/decode as metadata-only parts (their blob in the bucket)."),
        "ec_s3_proxy_items_without_params_total": ("counter", "Media items forwarded without encoder params."),
        "ec_s3_proxy_encoder_requests_total": ("counter", "Encoder requests by upstream and outcome."),
        "ec_s3_proxy_encoder_seconds_total": ("counter", "Time spent in encoder requests."),
        "ec_s3_proxy_pd_responses_total": ("counter", "PD answers relayed, by upstream and HTTP status."),
        "ec_s3_proxy_pd_failures_total": ("counter", "PD exchanges that failed below HTTP, by reason."),
        "ec_s3_proxy_pd_resends_total": (
            "counter", "PD requests cancelled and sent again without a failed encoder's pending marks."),
        "ec_s3_proxy_pd_retries_total": (
            "counter", "PD requests sent once more because vLLM's engine refused them before any token "
                       "(finish_reason 'error', which vLLM calls retryable), by upstream."),
        "ec_s3_proxy_encoder_skips_total": (
            "counter", "Media items sent to prefill/decode as known to be in the bucket, with no encoder request, "
                       "by how the proxy knew (answer: an encoder answered for it here; bucket: a HEAD)."),
        "ec_s3_proxy_bucket_lookups_total": ("counter", "The proxy's HEADs of items it did not know, by outcome."),
        "ec_s3_proxy_known_forgotten_total": (
            "counter", "Known items forgotten, by reason (missing: a consumer found no blob; expired; evicted)."),
        "ec_s3_proxy_known_entries": ("gauge", "Items the proxy knows are in the bucket (bounded by known_max_entries)."),
        "ec_s3_proxy_client_disconnects_total": ("counter", "Clients gone before their answer was relayed."),
        "ec_s3_proxy_rejected_total": ("counter", "Chat requests answered 4xx/503 by the proxy itself, by reason."),
        "ec_s3_proxy_internal_errors_total": ("counter", "Requests that hit a bug in the proxy (answered 500)."),
        "ec_s3_proxy_requests_in_flight": ("gauge", "Chat requests being handled (bounded by max_in_flight)."),
        "ec_s3_proxy_in_flight": ("gauge", "Requests outstanding per upstream."),
        "ec_s3_proxy_upstream_up": ("gauge", "0 while an upstream is skipped after refusing a connection."),
        "ec_s3_proxy_route_picks_total": (
            "counter", "Requests routed by affinity (--route affinity), by outcome: affinity (the first "
                       "rendezvous choice of the first media item), spill (it was over the load bound), "
                       "no_media (least-loaded)."),
    }

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._known(name)
        key = (name, tuple(sorted(labels.items())))
        self._values[key] = self._values.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        self._known(name)
        self._values[(name, tuple(sorted(labels.items())))] = value

    def _known(self, name: str) -> None:
        # A series without a help text would be counted but never rendered on /metrics.
        if name not in self._HELP:
            raise KeyError(f"unregistered proxy metric {name!r}")

    def get(self, name: str, **labels: str) -> float:
        """Sum of every series of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self._values.items() if n == name and want <= set(ls))

    def render(self) -> str:
        lines: list[str] = []
        for name, (kind, doc) in self._HELP.items():
            series = sorted((ls, v) for (n, ls), v in self._values.items() if n == name)
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")
            for ls, v in series:
                label_text = ",".join(f'{k}="{_escape_label(val)}"' for k, val in ls)
                lines.append(f"{name}{{{label_text}}} {v:g}" if label_text else f"{name} {v:g}")
        return "\n".join(lines) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
