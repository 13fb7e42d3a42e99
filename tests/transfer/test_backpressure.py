"""Producer memory stays bounded by max_inflight_bytes while the store stalls:
`block` makes save wait, `drop` skips and counts; everything flows again after."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ec_s3.config import ECS3Config
from ec_s3.transfer.publisher import BlobPublisher
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import S3Store
from support.faultproxy import FaultProxy

MiB = 1 << 20
ROWS, WIDTH = 128, 1024  # 256 KiB of bf16 per encoder output


def _publisher(store: S3Store, config: ECS3Config) -> tuple[BlobPublisher, Counters]:
    counters = Counters()
    return BlobPublisher(store, config, namespace="ns", producer="p", counters=counters), counters


def _tensor(i: int) -> torch.Tensor:
    return torch.full((ROWS, WIDTH), float(i)).to(torch.bfloat16)


def test_block_waits_then_flows(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    config = make_config(fault_proxy.endpoint_url, max_inflight_bytes=MiB, backpressure="block", read_timeout_s=30)
    store = make_store(fault_proxy.endpoint_url, read_timeout_s=30)
    publisher, counters = _publisher(store, config)
    fault_proxy.set_stall(True, methods=["PUT"])
    done = threading.Event()

    def save_all() -> None:
        for i in range(10):
            publisher.publish(f"id{i}", _tensor(i), f"k/{i}")
        done.set()

    thread = threading.Thread(target=save_all, daemon=True)
    thread.start()
    fault_proxy.wait_until(lambda c: c.held_now >= 3, timeout_s=10)
    time.sleep(0.5)
    assert not done.is_set(), "save should block while the pool is full"
    assert publisher.pool.used <= MiB and publisher.pool.peak <= MiB
    fault_proxy.set_stall(False)
    assert done.wait(30)
    assert publisher.flush(30) == 0
    assert publisher.pool.peak <= MiB and publisher.pool.used == 0
    assert counters.get("blobs_uploaded") == 10 and counters.get("upload_dropped") == 0
    assert all(store.run(store.head_async(f"k/{i}")) is not None for i in range(10))


def test_drop_skips_and_counts_then_flows(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    config = make_config(fault_proxy.endpoint_url, max_inflight_bytes=MiB, backpressure="drop", read_timeout_s=30)
    store = make_store(fault_proxy.endpoint_url, read_timeout_s=30)
    publisher, counters = _publisher(store, config)
    fault_proxy.set_stall(True, methods=["PUT"])
    started = time.monotonic()
    accepted = [publisher.publish(f"id{i}", _tensor(i), f"k/{i}") for i in range(10)]
    assert time.monotonic() - started < 1.0, "drop must never wait"
    fits = MiB // (ROWS * WIDTH * 2 + 256)
    assert sum(accepted) == fits == 3
    assert counters.get("upload_dropped") == 10 - fits
    assert publisher.pool.peak <= MiB
    fault_proxy.set_stall(False)
    assert publisher.flush(30) == 0
    # After the stall, new saves (and the dropped ones, saved again) go through.
    for i in range(10):
        if not accepted[i]:
            assert publisher.publish(f"id{i}", _tensor(i), f"k/{i}")
            assert publisher.flush(30) == 0
    assert counters.get("blobs_uploaded") == 10


def test_a_save_blocked_inside_a_step_wakes_the_loop_it_waits_for(
    make_config: Callable[..., ECS3Config], make_store: Callable[..., S3Store]
) -> None:
    """Inside a step the publisher holds wake-ups back until the step ends; a save that
    must wait for room would then wait for uploads nobody started. It wakes the loop."""
    config = make_config(max_inflight_bytes=MiB, backpressure="block")
    publisher, counters = _publisher(make_store(), config)
    done = threading.Event()

    def step() -> None:
        publisher.defer_wakeups()  # what the worker's start_save_caches does
        for i in range(10):
            publisher.publish(f"id{i}", _tensor(i), f"k/{i}")
        done.set()
        publisher.wake()  # the end of the step

    threading.Thread(target=step, daemon=True).start()
    assert done.wait(30), "a save blocked inside a step waited for uploads that never started"
    assert publisher.flush(30) == 0
    assert counters.get("blobs_uploaded") == 10 and publisher.pool.peak <= MiB
