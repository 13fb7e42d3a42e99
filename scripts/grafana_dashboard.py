"""Write deploy/kubernetes/base/monitoring/ec-s3-dashboard.json, the Grafana dashboard for ec-s3's Prometheus metrics.

The dashboard is generated so that its queries are code: tests/test_dashboard.py
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
PANELS: list[dict[str, Any]] = [
    row("Cache"),
    panel("Lookup hit rate", [(
        f"{rate('vllm:ec_s3_lookups_total', match=HIT)} / {rate('vllm:ec_s3_lookups_total')}",
        "hit rate")], unit="percentunit",
        description="Share of bucket lookups that found a blob (consumers: fetched and validated; producers: present)."),
    panel("Encoder work saved", [(
        f"{rate('vllm:ec_s3_blobs_loaded_total')} / ({rate('vllm:ec_s3_blobs_loaded_total')} + "
        f"{rate('vllm:ec_s3_fallbacks_local_total')})", "loaded / (loaded + encoded locally)")],
        unit="percentunit", description="Consumers: items loaded from S3 instead of encoded."),
    panel("Lookups by outcome", [(rate("vllm:ec_s3_lookups_total", by="outcome"), "{{outcome}}")], unit="ops"),
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
    row("Failures"),
    panel("Fallbacks and failed requests", [
        (rate("vllm:ec_s3_fallbacks_local_total"), "encoded locally after all"),
        (rate("vllm:ec_s3_requests_unavailable_total"), "requests failed"),
        (rate("vllm:ec_s3_invalid_blobs_total"), "invalid blobs"),
        (rate("vllm:ec_s3_promises_ignored_total"), "promises ignored")], unit="ops"),
    panel("Uploads not made", [
        (rate("vllm:ec_s3_upload_failures_total"), "failed"),
        (rate("vllm:ec_s3_uploads_dropped_total"), "dropped (backpressure)"),
        (rate("vllm:ec_s3_blobs_spooled_total"), "spooled")], unit="ops"),
    panel("Store health", [
        (rate("vllm:ec_s3_retries_total"), "retries"),
        (rate("vllm:ec_s3_store_errors_total"), "lookup errors"),
        (f"max(vllm:ec_s3_breaker_open{SEL})", "circuit open (1)")], unit="short",
        description="Retries and errors per second; the circuit breaker is 1 while requests to the store are "
                    "skipped after repeated failures."),
    row("Memory"),
    panel("Bytes held", [
        (f"sum(vllm:ec_s3_inflight_bytes{SEL})", "producer: waiting for upload"),
        (f"sum(vllm:ec_s3_staged_bytes{SEL})", "consumer: staged"),
        (f"sum(vllm:ec_s3_spool_bytes{SEL})", "producer: spooled")], unit="bytes"),
]


def dashboard() -> dict[str, Any]:
    panels, y = [], 0
    for i, p in enumerate(PANELS):
        p = dict(p, id=i + 1)
        if p["type"] == "row":
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
