"""ec-s3 in vLLM's metrics: the stats payload and its Prometheus families.

The payload is a plain dict (counters, gauges, samples) that survives vLLM's IPC;
``COUNTERS``, ``GAUGES`` and ``HISTOGRAMS`` map ec-s3's counter names to Prometheus
metrics. Worker counters arrive through the scheduler side (:func:`scheduler_stats`), so a
worker-role connector reports nothing itself. Owns the payload, its aggregation and the
Prometheus families. Does not own the counting (:class:`ec_s3.transfer.counters.Counters`)
or when vLLM collects. Details: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats

from ec_s3.transfer.counters import MAX_SAMPLES, Counters, DeltaSource
from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.loop import BackgroundLoop
from ec_s3.transfer.fsutil import ensure_private_dir
from ec_s3.transfer.shared_stats import SharedStatsReader, SharedStatsWriter, stats_dir

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "COUNTERS",
    "ECS3PromMetrics",
    "ECS3Stats",
    "GAUGES",
    "HISTOGRAMS",
    "LOOKUP_OUTCOMES",
    "POLL_OUTCOMES",
    "exported_counter_names",
    "open_stats_reader",
    "open_stats_writer",
    "scheduler_stats",
    "stats_identity",
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
    "vllm:ec_s3_retries_total": ("S3 requests retried (throttling, 5xx, connection errors).", "store_retries"),
    "vllm:ec_s3_hedges_total": (
        "GET ranges asked again on another connection for running past hedge_after_factor x their expected time.",
        "store_hedges"),
    "vllm:ec_s3_hedges_won_total": ("Hedged GET ranges whose second request answered first (its answer used).",
                                    "store_hedges_won"),
    "vllm:ec_s3_store_errors_total": ("Lookups that failed with a store error.", "store_errors"),
    "vllm:ec_s3_promises_ignored_total": ("ec_transfer_params entries ignored as invalid or foreign (foreign ones also in promises_foreign).", "promises_ignored"),
    "vllm:ec_s3_promises_foreign_total": (
        "ec_transfer_params entries refused at once because their producer publishes to another bucket, prefix or "
        "model namespace (a fleet configured inconsistently).", "promises_foreign"),
    "vllm:ec_s3_items_encoded_total": (
        "Media items vLLM's encoder ran on this engine (any role): what the bucket did not save here.", "items_encoded"),
    "vllm:ec_s3_lookups_started_total": ("Bucket lookups started (HEAD for producers, GET for consumers).", "lookups_started"),
    "vllm:ec_s3_uploads_started_total": ("Uploads queued by save_caches.", "upload_started"),
    "vllm:ec_s3_uploads_already_present_total": ("Uploads answered 412: another producer had written the same blob.", "upload_already_present"),
    "vllm:ec_s3_uploads_answer_lost_total": (
        "Uploads whose answer was lost and whose resend met their own blob (412 on their write token); also in "
        "blobs_uploaded.", "store_lost_answer_writes"),
    "vllm:ec_s3_uploads_abandoned_total": ("Uploads still pending when the producer shut down and could not be spooled.", "upload_abandoned"),
    "vllm:ec_s3_save_blocked_seconds_total": ("Time save_caches waited for upload room (backpressure=block).", "save_blocked_seconds"),
    "vllm:ec_s3_spool_uploaded_total": ("Spooled blobs uploaded once the store answered again.", "spool_uploaded"),
    "vllm:ec_s3_spool_failed_total": ("Spooled blobs set aside after failing repeatedly.", "spool_failed"),
    "vllm:ec_s3_spool_full_drops_total": ("Blobs dropped because the spool was full (spool_max_bytes).", "spool_full_drops"),
    "vllm:ec_s3_spool_rejected_total": ("Files in spool_dir refused (malformed, or a key outside this namespace).", "spool_rejected"),
    "vllm:ec_s3_spool_drain_errors_total": ("Unexpected errors of the spool's drain task (it keeps running).", "spool_drain_errors"),
    "vllm:ec_s3_staging_no_space_total": ("Fetches refused because staging (staging_bytes or the tmpfs) had no room.", "staging_no_space"),
    "vllm:ec_s3_staging_read_failures_total": ("Staged blobs a worker could not read (then fetched from S3 or failed).", "staging_read_failures"),
    "vllm:ec_s3_staging_reopened_total": (
        "Staged blobs a worker read through the scheduler's open file because their path in staging_dir was gone "
        "or replaced (another process cleans it).", "staging_reopened"),
    "vllm:ec_s3_loads_encoded_locally_total": ("Promised hits a worker could not load and had vLLM encode in the same step instead.", "loads_encoded_locally"),
    "vllm:ec_s3_remote_loads_total": ("Blobs a worker on another host than its scheduler fetched from S3 itself.", "remote_loads"),
    "vllm:ec_s3_remote_load_failures_total": ("Such fetches that failed after their retries.", "remote_load_failures"),
    "vllm:ec_s3_remote_load_seconds_total": (
        "Time model steps waited for a worker's own S3 fetch (bounded per fetch by remote_load_timeout_s).",
        "remote_load_seconds"),
    "vllm:ec_s3_promises_withheld_total": ("Producer: items sent without a promise because the store was down (circuit open).", "promises_withheld"),
    "vllm:ec_s3_present_missing_total": (
        "Items the proxy marked present that the bucket did not have (deleted since): encoded locally, reported back.",
        "present_missing"),
    "vllm:ec_s3_settle_steps_total": (
        "Engine steps that scheduled nothing, taken while ec-s3 waited for its workers' counters to reach /metrics "
        "(has_pending_push_work; at most 5 s after a step that uploaded or loaded).", "settle_steps"),
    "vllm:ec_s3_promise_timeouts_total": ("Promised items given up: not visible within promised_wait_s, or their producer is down.", "promise_timeouts"),
}
# lookups_total{outcome}: what each request's lookup of an item decided, counted once
# when it is decided (ec_s3.connector.scheduler); a hit rate is hit / all of them.
LOOKUP_OUTCOMES: dict[str, str] = {
    "hit": "lookups_hit", "miss": "lookups_miss", "timeout": "lookup_timeouts", "error": "lookup_errors",
}
# lookup_polls_total{outcome}: every answer of the bucket to a lookup's GET or HEAD,
# each poll of a promised item that is not there yet included (a failed one is a
# store error).
POLL_OUTCOMES: dict[str, str] = {"hit": "polls_hit", "miss": "polls_miss"}
GAUGES: dict[str, tuple[str, str]] = {
    "vllm:ec_s3_inflight_bytes": ("Producer bytes waiting for upload (bounded by max_inflight_bytes).", "inflight_bytes"),
    "vllm:ec_s3_staged_bytes": ("Consumer bytes held in the shared staging area.", "staged_bytes"),
    "vllm:ec_s3_spool_bytes": ("Producer bytes waiting in the outage spool.", "spool_bytes"),
    "vllm:ec_s3_spool_blobs": ("Producer blobs waiting in the outage spool.", "spool_blobs"),
    "vllm:ec_s3_breaker_open": ("1 while the circuit breaker skips requests to the store after repeated failures.", "breaker_open"),
}
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "vllm:ec_s3_upload_seconds": ("Time to upload one blob (PUT or multipart).", "upload_seconds"),
    "vllm:ec_s3_download_seconds": ("Time to fetch and validate one blob.", "download_seconds"),
    "vllm:ec_s3_promise_wait_seconds": (
        "Time a request waited for a promised item, until it was staged or given up.", "promise_wait_seconds"),
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
            ("hits", "lookups_hit"), ("misses", "lookups_miss"), ("timeouts", "lookup_timeouts"),
            ("fallbacks", "fallbacks_local"),
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
        def by_outcome(name: str, doc: str, outcomes: dict[str, str]) -> dict[str, dict[int, Any]]:
            family = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "outcome"])
            return {
                key: {idx: family.labels(*values, outcome) for idx, values in per_engine_labelvalues.items()}
                for outcome, key in outcomes.items()
            }

        self._lookups = by_outcome(
            "vllm:ec_s3_lookups_total",
            "What a request's lookup of an item in the bucket decided, once per request and item (hit: fetched or "
            "present; miss: not there; timeout: the request's wait, lookup_wait_s or promised_wait_s, ran out first; "
            "error: a failed lookup, an invalid blob, no room in staging). Polls are lookup_polls_total.",
            LOOKUP_OUTCOMES,
        )
        self._lookups.update(by_outcome(
            "vllm:ec_s3_lookup_polls_total",
            "Answers of the bucket to lookups' GETs (consumers) and HEADs (producers), each poll of a promised item "
            "not there yet included (hit: fetched or present; miss: 404).",
            POLL_OUTCOMES,
        ))
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


def stats_identity(vllm_config: VllmConfig) -> str:
    """What a scheduler and its own workers share, and no other engine does: vLLM's
    engine id (passed to the workers with the config) and the data-parallel rank
    (DP engines share one ec_transfer_config)."""
    ec_config = vllm_config.ec_transfer_config
    assert ec_config is not None
    dp_rank = getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0
    return f"{ec_config.engine_id}-dp{dp_rank}"


def scheduler_stats(counters: Counters, workers: SharedStatsReader | None) -> ECS3Stats | None:
    """The scheduler-role connector's stats (its caller pulled its store's counters in
    first), plus its workers' counters from shared memory."""
    stats = ECS3Stats(data=counters.take_delta())
    if workers is not None:
        stats.aggregate(ECS3Stats(data=workers.take_delta()))
    return None if stats.is_empty() else stats


def exported_counter_names() -> set[str]:
    """Every internal counter, gauge and histogram name that reaches Prometheus."""
    names = {key for _, key in COUNTERS.values()} | set(LOOKUP_OUTCOMES.values()) | set(POLL_OUTCOMES.values())
    return names | {key for _, key in GAUGES.values()} | {key for _, key in HISTOGRAMS.values()}


def open_stats_writer(
    config: ECS3Config, vllm_config: VllmConfig, counters: Counters, loop: BackgroundLoop,
    sources: Sequence[DeltaSource] = (),
) -> SharedStatsWriter | None:
    """The worker side of the stats route (first worker of an engine only), pulling
    ``sources`` (the worker's store) into ``counters`` before each flush; None, with one
    warning, when the shared directory cannot be used (metrics must never stop a
    worker)."""
    try:
        writer = SharedStatsWriter(str(_stats_directory(config)), stats_identity(vllm_config), counters, sources)
    except (OSError, ValueError) as exc:
        logger.warning(
            "ec-s3: worker counters (uploads, loads) will not reach /metrics: cannot write them to %s (%s); "
            "check staging_dir", config.staging_dir, exc,
        )
        return None
    writer.flush_periodically(loop)
    return writer


def open_stats_reader(config: ECS3Config, vllm_config: VllmConfig, loop: BackgroundLoop) -> SharedStatsReader | None:
    """The scheduler side of the stats route, collecting on ``loop`` (never on the
    engine thread); removes files dead workers left."""
    try:
        directory = _stats_directory(config)
    except (OSError, ValueError) as exc:
        logger.warning("ec-s3: worker counters will not reach /metrics: %s", exc)
        return None
    reader = SharedStatsReader(str(directory), stats_identity(vllm_config))
    reader.remove_dead()
    reader.collect_periodically(loop)
    return reader


def _stats_directory(config: ECS3Config) -> Path:
    ensure_private_dir(config.staging_dir, key="staging_dir", shared_ok=True)
    return ensure_private_dir(stats_dir(config.staging_dir), key="staging_dir")
