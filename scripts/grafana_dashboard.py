"""Write deploy/kubernetes/base/monitoring/ec-s3-dashboard.json, the Grafana dashboard for ec-s3's Prometheus metrics.

The dashboard is generated so that its queries are code: tests/deploy/test_dashboard.py
checks that the committed JSON equals this script's output and that every metric a
query names is one ec-s3 really exports. Regenerate after changing a panel:

    .venv/bin/python scripts/grafana_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Under deploy/kubernetes/ because kustomize loads files only below its root; compose
# mounts the same file (compose.yaml, profile monitoring).
OUT = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "base" / "monitoring" / "ec-s3-dashboard.json"
SEL = '{model_name=~"$model_name"}'
W = "$__rate_interval"


def rate(metric: str, by: str = "", match: str = "") -> str:
    sel = SEL if not match else SEL[:-1] + f",{match}}}"
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({metric}{sel}[{W}]))"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}[{W}])))"


def panel(title: str, targets: list[tuple[str, str]], *, unit: str = "short", kind: str = "timeseries",
          description: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(targets)],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


HIT = 'outcome="hit"'
# The proxy's families carry no model_name (one proxy serves one model); `job` is the
# scrape job, which compose and the ServiceMonitor both name after the Service.
JOBS = 'job=~"ec-s3-encoder|ec-s3-pd|ec-s3-proxy"'


def proxy_rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({metric}[{W}]))"


PANELS: list[dict[str, Any]] = [
    row("Scrape targets"),
    panel("Targets up", [
        (f"sum by (job) (up{{{JOBS}}})", "{{job}} up"),
        (f"count by (job) (up{{{JOBS}}})", "{{job}} discovered")], unit="short",
        description="Targets Prometheus scrapes successfully (up) out of those it discovered, per job."),
    panel("Servers exporting ec-s3", [
        (f"count(vllm:ec_s3_breaker_open{SEL})", "vLLM engines with ec-s3 loaded"),
        ("count(ec_s3_proxy_requests_in_flight)", "ec-s3 proxies")], unit="short",
        description="Up but missing here: vLLM runs without the connector (--ec-transfer-config), or the target is "
                    "not an ec-s3 proxy."),
    row("Cache"),
    panel("Lookup hit rate", [(
        f"{rate('vllm:ec_s3_lookups_total', match=HIT)} / {rate('vllm:ec_s3_lookups_total')}",
        "hit rate")], unit="percentunit",
        description="Share of items' lookups that decided hit (consumers: fetched and validated; producers: "
                    "present), one per request and item: hit / (hit + miss + timeout + error). Polls of a promised "
                    "item that is not there yet are no lookups (vllm:ec_s3_lookup_polls_total)."),
    panel("Encoder work saved", [
        (f"{rate('vllm:ec_s3_blobs_loaded_total')} / ({rate('vllm:ec_s3_blobs_loaded_total')} + "
         f"{rate('vllm:ec_s3_fallbacks_local_total')})", "loaded / (loaded + encoded locally)"),
        (f"{rate('vllm:ec_s3_fallbacks_local_total')} / ({rate('vllm:ec_s3_blobs_loaded_total')} + "
         f"{rate('vllm:ec_s3_fallbacks_local_total')})", "encoded locally after all")],
        unit="percentunit", description="Consumers: promised items loaded from S3 instead of encoded, and the "
                                        "share encoded again locally (alert EcS3LocalFallbacksHigh above 10%)."),
    panel("Lookups by outcome", [(rate("vllm:ec_s3_lookups_total", by="outcome"), "{{outcome}}"),
                                 (rate("vllm:ec_s3_lookup_polls_total", by="outcome"), "bucket answered: {{outcome}}"),
                                 (rate("vllm:ec_s3_lookups_started_total"), "GETs / HEADs started")], unit="ops",
          description="What items' lookups decided (one per request and item), and every answer of the bucket to "
                      "their GETs and HEADs, polls of promised items included."),
    panel("Encoder runs and loads", [(rate("vllm:ec_s3_items_encoded_total"), "items encoded here"),
                                     (rate("vllm:ec_s3_blobs_loaded_total"), "items loaded from S3"),
                                     (rate("vllm:ec_s3_settle_steps_total"), "idle steps for worker counters")],
          unit="ops",
          description="Every role: media items vLLM's encoder ran on the engine, against those loaded instead; and "
                      "the empty engine steps ec-s3 asked for so that its workers' counters reach /metrics."),
    row("Transfers"),
    panel("Throughput", [(rate("vllm:ec_s3_bytes_uploaded_total"), "uploaded"),
                         (rate("vllm:ec_s3_bytes_downloaded_total"), "downloaded")], unit="Bps"),
    panel("Blobs", [(rate("vllm:ec_s3_blobs_uploaded_total"), "uploaded"),
                    (rate("vllm:ec_s3_blobs_downloaded_total"), "downloaded"),
                    (rate("vllm:ec_s3_blobs_loaded_total"), "loaded into the encoder cache")], unit="ops"),
    panel("Upload / download latency", [
        (quantile(0.5, "vllm:ec_s3_upload_seconds"), "upload p50"),
        (quantile(0.99, "vllm:ec_s3_upload_seconds"), "upload p99"),
        (quantile(0.5, "vllm:ec_s3_download_seconds"), "download p50"),
        (quantile(0.99, "vllm:ec_s3_download_seconds"), "download p99")], unit="s"),
    panel("Wait for promised items", [
        (quantile(0.5, "vllm:ec_s3_promise_wait_seconds"), "p50"),
        (quantile(0.99, "vllm:ec_s3_promise_wait_seconds"), "p99")], unit="s",
        description="Consumers: how long a request waited for a blob its producer promised (served or given up)."),
    panel("Promises", [
        (rate("vllm:ec_s3_promise_timeouts_total"), "given up (promised_wait_s, producer down)"),
        (rate("vllm:ec_s3_promises_withheld_total"), "withheld by producers (circuit open)"),
        (rate("vllm:ec_s3_promises_ignored_total"), "ignored (invalid or foreign)"),
        (rate("vllm:ec_s3_promises_foreign_total"), "refused: producer publishes to another namespace"),
        (rate("vllm:ec_s3_present_missing_total"), "marked present by the proxy, gone (encoded locally)")],
        unit="ops"),
    row("Failures"),
    panel("Fallbacks and failed requests", [
        (rate("vllm:ec_s3_fallbacks_local_total"), "encoded locally after all"),
        (rate("vllm:ec_s3_requests_unavailable_total"), "requests failed"),
        (rate("vllm:ec_s3_invalid_blobs_total"), "invalid blobs"),
        (rate("vllm:ec_s3_promises_ignored_total"), "promises ignored")], unit="ops"),
    panel("Uploads not made", [
        (rate("vllm:ec_s3_upload_failures_total"), "failed"),
        (rate("vllm:ec_s3_uploads_dropped_total"), "dropped (backpressure)"),
        (rate("vllm:ec_s3_uploads_abandoned_total"), "abandoned at shutdown"),
        (rate("vllm:ec_s3_blobs_spooled_total"), "spooled")], unit="ops"),
    panel("Store health", [
        (rate("vllm:ec_s3_retries_total"), "retries"),
        (rate("vllm:ec_s3_store_errors_total"), "lookup errors"),
        (rate("vllm:ec_s3_hedges_total"), "GET ranges hedged"),
        (rate("vllm:ec_s3_hedges_won_total"), "hedges that answered first"),
        (f"max(vllm:ec_s3_breaker_open{SEL})", "circuit open (1)")], unit="short",
        description="Retries, errors and hedged GET ranges per second; the circuit breaker is 1 while requests to "
                    "the store are skipped after repeated failures."),
    row("Encoders (producers)"),
    panel("Uploads", [
        (rate("vllm:ec_s3_uploads_started_total"), "started"),
        (rate("vllm:ec_s3_blobs_uploaded_total"), "uploaded"),
        (rate("vllm:ec_s3_uploads_already_present_total"), "already present (412)"),
        (rate("vllm:ec_s3_uploads_answer_lost_total"), "ours, answer lost (412 on resend)")], unit="ops"),
    panel("Encoder blocked on uploads", [
        (rate("vllm:ec_s3_save_blocked_seconds_total"), "save_caches waiting for room")], unit="percentunit",
        description="Seconds per second save_caches waited for room in max_inflight_bytes (backpressure=block); "
                    "alert EcS3EncoderBlockedOnUploads above 10%."),
    panel("Outage spool", [
        (rate("vllm:ec_s3_blobs_spooled_total"), "spooled"),
        (rate("vllm:ec_s3_spool_uploaded_total"), "uploaded later"),
        (rate("vllm:ec_s3_spool_failed_total"), "set aside (failing)"),
        (rate("vllm:ec_s3_spool_full_drops_total"), "dropped (spool full)"),
        (rate("vllm:ec_s3_spool_rejected_total"), "files refused"),
        (rate("vllm:ec_s3_spool_drain_errors_total"), "drain task errors"),
        (f"sum(vllm:ec_s3_spool_blobs{SEL})", "blobs waiting"),
        (f"sum(vllm:ec_s3_spool_bytes{SEL})", "bytes waiting")], unit="short",
        description="Rates per second, and what the spool holds now (alert EcS3SpoolNotDraining)."),
    row("Prefill/decode (consumers)"),
    panel("Staging", [
        (rate("vllm:ec_s3_staging_no_space_total"), "fetches refused: no room"),
        (rate("vllm:ec_s3_staging_read_failures_total"), "staged blobs unreadable"),
        (rate("vllm:ec_s3_staging_reopened_total"), "read through the scheduler's open file")], unit="ops",
        description="No room: staging_bytes or the /dev/shm tmpfs is full (alert EcS3StagingFull). Read through "
                    "the open file: another process deletes files in staging_dir."),
    panel("Worker loads", [
        (rate("vllm:ec_s3_loads_encoded_locally_total"), "encoded in the step instead"),
        (rate("vllm:ec_s3_remote_loads_total"), "fetched by a worker on another host"),
        (rate("vllm:ec_s3_remote_load_failures_total"), "such fetches failed")], unit="ops"),
    panel("Model steps waiting for worker fetches", [
        (rate("vllm:ec_s3_remote_load_seconds_total"), "waited")], unit="percentunit",
        description="Seconds per second model steps waited for a worker's own S3 fetch (multi-host engines)."),
    row("Memory"),
    panel("Bytes held", [
        (f"sum(vllm:ec_s3_inflight_bytes{SEL})", "producer: waiting for upload"),
        (f"sum(vllm:ec_s3_staged_bytes{SEL})", "consumer: staged"),
        (f"sum(vllm:ec_s3_spool_bytes{SEL})", "producer: spooled")], unit="bytes"),
    row("Proxy"),
    panel("Proxy requests", [
        (proxy_rate("ec_s3_proxy_requests_total", by="kind"), "{{kind}}"),
        (proxy_rate("ec_s3_proxy_rejected_total", by="reason"), "rejected: {{reason}}"),
        (proxy_rate("ec_s3_proxy_internal_errors_total"), "internal errors (500)"),
        (proxy_rate("ec_s3_proxy_client_disconnects_total"), "clients gone"),
        ("sum(ec_s3_proxy_requests_in_flight)", "in flight")], unit="short",
        description="Per second, and requests being handled now (bounded by max_in_flight)."),
    panel("Proxy upstreams", [
        ("min by (role, upstream) (ec_s3_proxy_upstream_up)", "{{role}} {{upstream}} up"),
        ("sum by (role, upstream) (ec_s3_proxy_in_flight)", "{{role}} {{upstream}} in flight")], unit="short",
        description="An upstream is 0 while the proxy skips it after a refused connection."),
    panel("Proxy to encoders", [
        (proxy_rate("ec_s3_proxy_encoder_requests_total", by="outcome"), "{{outcome}}"),
        (f"{proxy_rate('ec_s3_proxy_encoder_seconds_total')} / {proxy_rate('ec_s3_proxy_encoder_requests_total')}",
         "mean seconds per encoder request")], unit="short"),
    panel("Proxy to prefill/decode", [
        (proxy_rate("ec_s3_proxy_pd_responses_total", by="status"), "HTTP {{status}}"),
        (proxy_rate("ec_s3_proxy_pd_failures_total", by="reason"), "failed: {{reason}}"),
        (proxy_rate("ec_s3_proxy_pd_resends_total"), "resent"),
        (proxy_rate("ec_s3_proxy_pd_retries_total"), "sent once more (engine refused it)")], unit="ops"),
    panel("Proxy media items", [
        (proxy_rate("ec_s3_proxy_mm_items_total"), "items seen"),
        (proxy_rate("ec_s3_proxy_items_without_params_total"), "forwarded without encoder params"),
        (proxy_rate("ec_s3_proxy_metadata_only_items_total"), "sent metadata-only (no image)")], unit="ops",
        description="Items without params are encoded by prefill/decode itself (alert EcS3ProxyItemsWithoutParams); "
                    "metadata-only items reach it without their image (docs/proxy.md)."),
    panel("Proxy encoder skips", [
        (proxy_rate("ec_s3_proxy_encoder_skips_total", by="source"), "skipped: known from {{source}}"),
        (proxy_rate("ec_s3_proxy_bucket_lookups_total", by="outcome"), "bucket HEAD: {{outcome}}"),
        (proxy_rate("ec_s3_proxy_known_forgotten_total", by="reason"), "forgotten: {{reason}}"),
        ("sum(ec_s3_proxy_known_entries)", "entries known")], unit="short",
        description="Repeated images sent to prefill/decode without an encoder request (docs/proxy.md)."),
    panel("Proxy routing", [
        (proxy_rate("ec_s3_proxy_route_picks_total", by="outcome"), "{{outcome}}")], unit="ops",
        description="--route affinity: requests sent to their first image's server (affinity), to the next one "
                    "because it was over the load bound (spill), or least-loaded (no media)."),
]

def dashboard() -> dict[str, Any]:
    panels, x, y = [], 0, 0
    for i, p in enumerate(PANELS):
        p = dict(p, id=i + 1)
        if p["type"] == "row":
            if x:  # the last row's panels did not fill their line: start below them
                y += 8
            p["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
            x = 0
        else:
            p["gridPos"] = {"h": 8, "w": 8, "x": x, "y": y}
            x += 8
            if x >= 24:
                x, y = 0, y + 8
        panels.append(p)
    return {
        "title": "ec-s3 encoder cache",
        "uid": "ec-s3",
        "description": "ec-s3 (S3 encoder cache for vLLM EPD): hit rate, bytes, latencies, fallbacks, store health.",
        "tags": ["vllm", "ec-s3"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model_name", "type": "query", "label": "model",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": "label_values(vllm:ec_s3_lookups_total, model_name)",
             "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
