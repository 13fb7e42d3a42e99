"""Bounds on the scheduler side: the item table stays bounded however many distinct
items pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.v1.engine import FinishReason

from ec_s3.store.client import S3Store
from support.ec_harness import drive, make_node
from support.vllm_rig import fake_encoder_output
from test_consumer import put_blob

ROWS = 16


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
