"""ec-s3 in vLLM's metrics: the stats payload and its Prometheus families.

vLLM asks each connector for stats every engine step (``get_ec_connector_stats``),
aggregates them across workers (``ECConnectorStats.aggregate``), logs a summary
periodically (``reduce``) and hands the aggregate to the connector's Prometheus
class (``observe``). The payload is a plain dict, so it survives vLLM's IPC::

    {"counters": {name: increment}, "gauges": {name: value}, "samples": {name: [s]}}

Counter names below are ec-s3's internal counter names (see the modules that
increment them); ``COUNTERS``, ``GAUGES`` and ``HISTOGRAMS`` map them to Prometheus metrics.

vLLM's V1 model runner never asks a worker-role connector for stats, so the
scheduler-role connector of the same process (single-process executor) reports the
worker-role counters too, until vLLM collects them itself (model runner V2 "claims"
them): :func:`worker_stats` and :func:`scheduler_stats`.

Owns the payload, its aggregation and the Prometheus families. Does not own the counting
(:class:`ec_s3.transfer.counters.Counters`) or when vLLM collects.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

from ec_s3.transfer.counters import MAX_SAMPLES, Counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "COUNTERS",
    "ECS3PromMetrics",
    "ECS3Stats",
    "GAUGES",
    "HISTOGRAMS",
    "LOOKUP_OUTCOMES",
    "register_worker_counters",
    "scheduler_stats",
    "unregister_worker_counters",
    "worker_stats",
]

# Prometheus counter -> (documentation, internal counter name)
COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:ec_s3_blobs_uploaded_total": ("Encoder outputs uploaded to S3 (new objects).", "blobs_uploaded"),
    "vllm:ec_s3_bytes_uploaded_total": ("Bytes of encoder outputs uploaded to S3.", "bytes_uploaded"),
    "vllm:ec_s3_blobs_downloaded_total": ("Blobs fetched from S3 and validated into staging.", "blobs_downloaded"),
    "vllm:ec_s3_bytes_downloaded_total": ("Bytes fetched from S3 into staging.", "bytes_downloaded"),
    "vllm:ec_s3_blobs_loaded_total": ("Encoder outputs loaded into the encoder cache instead of encoding.", "blobs_loaded"),
    "vllm:ec_s3_fallbacks_local_total": ("Promised items encoded locally after all (late, missing, invalid, outage).", "fallbacks_local"),
    "vllm:ec_s3_requests_unavailable_total": ("Requests failed because a needed item could not be fetched and no media was left.", "requests_unavailable"),
    "vllm:ec_s3_invalid_blobs_total": ("Blobs rejected by validation (corrupt, wrong shape/dtype, checksum).", "invalid_blobs"),
    "vllm:ec_s3_upload_failures_total": ("Uploads given up (retries spent without a spool, or dropped by backpressure).", "upload_failed"),
    "vllm:ec_s3_uploads_dropped_total": ("Uploads skipped because max_inflight_bytes was full (backpressure=drop).", "upload_dropped"),
    "vllm:ec_s3_blobs_spooled_total": ("Blobs written to the outage spool.", "blobs_spooled"),
    "vllm:ec_s3_retries_total": ("S3 requests retried (throttling, 5xx, connection errors).", "retries"),
    "vllm:ec_s3_store_errors_total": ("Lookups that failed with a store error.", "store_errors"),
    "vllm:ec_s3_promises_ignored_total": ("ec_transfer_params entries ignored as invalid or foreign.", "promises_ignored"),
}
# lookups_total{outcome}
LOOKUP_OUTCOMES: dict[str, str] = {"hit": "lookups_hit", "miss": "lookups_miss", "timeout": "lookup_timeouts"}
GAUGES: dict[str, tuple[str, str]] = {
    "vllm:ec_s3_inflight_bytes": ("Producer bytes waiting for upload (bounded by max_inflight_bytes).", "inflight_bytes"),
    "vllm:ec_s3_staged_bytes": ("Consumer bytes held in the shared staging area.", "staged_bytes"),
    "vllm:ec_s3_spool_bytes": ("Producer bytes waiting in the outage spool.", "spool_bytes"),
}
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "vllm:ec_s3_upload_seconds": ("Time to upload one blob (PUT or multipart).", "upload_seconds"),
    "vllm:ec_s3_download_seconds": ("Time to fetch and validate one blob.", "download_seconds"),
}
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class ECS3Stats(ECConnectorStats):
    def __post_init__(self) -> None:
        for part in ("counters", "gauges", "samples"):
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "samples": {}}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        if not isinstance(other, ECS3Stats) or other.is_empty():
            return self
        counters, gauges, samples = self.data["counters"], self.data["gauges"], self.data["samples"]
        for name, value in other.data["counters"].items():
            counters[name] = counters.get(name, 0.0) + value
        for name, value in other.data["gauges"].items():
            gauges[name] = gauges.get(name, 0.0) + value  # disjoint sources: one per process
        for name, values in other.data["samples"].items():
            mine = samples.setdefault(name, [])
            mine.extend(values[: max(0, MAX_SAMPLES - len(mine))])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The periodic log line: what an operator checks first."""
        c = self.data["counters"]
        out: dict[str, int | float] = {}
        for label, name in (
            ("uploaded", "blobs_uploaded"), ("downloaded", "blobs_downloaded"), ("loaded", "blobs_loaded"),
            ("hits", "lookups_hit"), ("misses", "lookups_miss"), ("fallbacks", "fallbacks_local"),
            ("unavailable", "requests_unavailable"), ("invalid", "invalid_blobs"),
            ("upload_failures", "upload_failed"), ("spooled", "blobs_spooled"),
        ):
            if c.get(name):
                out[label] = int(c[name])
        for label, name in (("MB_up", "bytes_uploaded"), ("MB_down", "bytes_downloaded")):
            if c.get(name):
                out[label] = round(c[name] / 1e6, 2)
        for label, name in (("avg_upload_ms", "upload_seconds"), ("avg_download_ms", "download_seconds")):
            values = self.data["samples"].get(name)
            if values:
                out[label] = round(1000 * sum(values) / len(values), 1)
        return out

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["samples"])


class ECS3PromMetrics(ECConnectorPromMetrics):
    """Registers ec-s3's Prometheus families, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        self._counters = {
            key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for name, (doc, key) in COUNTERS.items()
        }
        lookups = self._counter_cls(
            name="vllm:ec_s3_lookups_total",
            documentation="Item lookups in the bucket by outcome (hit: fetched or present; miss: not there; timeout: "
                          "not answered within lookup_wait_s).",
            labelnames=[*labelnames, "outcome"],
        )
        self._lookups = {
            key: {idx: lookups.labels(*values, outcome) for idx, values in per_engine_labelvalues.items()}
            for outcome, key in LOOKUP_OUTCOMES.items()
        }
        self._gauges = {
            key: per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                            multiprocess_mode="mostrecent"))
            for name, (doc, key) in GAUGES.items()
        }
        self._histograms = {
            key: per_engine(self._histogram_cls(name=name, documentation=doc, labelnames=labelnames, buckets=_BUCKETS))
            for name, (doc, key) in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters = transfer_stats_data.get("counters", {})
        for key, family in self._counters.items():
            if counters.get(key):
                family[engine_idx].inc(counters[key])
        for key, family in self._lookups.items():
            if counters.get(key):
                family[engine_idx].inc(counters[key])
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if key in self._gauges:
                self._gauges[key][engine_idx].set(value)
        for key, values in transfer_stats_data.get("samples", {}).items():
            if key in self._histograms:
                for value in values:
                    self._histograms[key][engine_idx].observe(value)


# Worker-role counters of this process, for the scheduler-role connector to report
# while vLLM does not collect them itself (see the module docstring).
_WORKER_COUNTERS: list[Counters] = []


def register_worker_counters(counters: Counters) -> None:
    _WORKER_COUNTERS.append(counters)


def unregister_worker_counters(counters: Counters) -> None:
    if counters in _WORKER_COUNTERS:
        _WORKER_COUNTERS.remove(counters)


def worker_stats(counters: Counters) -> ECS3Stats | None:
    """A worker-role connector's stats, asked by vLLM itself: from now on the
    scheduler side leaves these counters alone."""
    counters.claimed = True
    stats = ECS3Stats(data=counters.take_delta())
    return None if stats.is_empty() else stats


def scheduler_stats(counters: Counters, store_retries: int) -> ECS3Stats | None:
    """The scheduler-role connector's stats, plus this process's unclaimed worker-role
    counters and the store's retries since the last call."""
    stats = ECS3Stats(data=counters.take_delta())
    if store_retries:
        stats.data["counters"]["retries"] = store_retries
    for worker in _WORKER_COUNTERS:
        if not worker.claimed:
            stats.aggregate(ECS3Stats(data=worker.take_delta()))
    return None if stats.is_empty() else stats
