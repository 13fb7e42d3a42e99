"""S3Store resources under faults: pooled connections, parallel parts, the breaker.

Each test here once failed on the store: a GET whose allocator raised leaked its
pooled connection (after ``max_pool_connections`` of them every request hung); a full
pool was waited for forever; a failed ranged GET left its sibling parts writing into
the caller's buffer; a breaker probe that ended in a non-store exception kept the
breaker open for good.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import PutOutcome, S3Store, StoreError, StoreUnavailable
from support.faultproxy import FaultProxy


MiB = 1 << 20


class Refused(Exception):
    """What a caller's allocator raises (staging full, slot exists, OSError...)."""


def _refuse(nbytes: int) -> memoryview:
    raise Refused(nbytes)


def test_allocator_failure_releases_the_connection(make_store: Callable[..., S3Store]) -> None:
    """6 MiB is more than the socket buffers hold, so an unread body pins its connection."""
    store = make_store(max_pool_connections=2)
    data = os.urandom(6 * MiB)
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    for _ in range(5):  # more than the pool
        with pytest.raises(Refused):
            store.run(store.get_async("k", allocate=_refuse), timeout=30)
    assert store.run(store.head_async("k"), timeout=20) is not None
    assert bytes(store.run(store.get_async("k"), timeout=20)) == data


def test_waiting_for_a_pooled_connection_is_bounded(make_store: Callable[..., S3Store]) -> None:
    """A connection held elsewhere (here: a body nobody reads) must not make the store's
    next request wait forever for the pool; it fails as transient instead."""
    writer = make_store()
    writer.run(writer.put_async("k", os.urandom(6 * MiB)), timeout=60)
    store = make_store(max_pool_connections=1, connect_timeout_s=0.2, read_timeout_s=1.0, max_attempts=1)

    async def scenario() -> object:
        client = await store._get_client()
        if getattr(store._transport, "wire", None) is not None:
            # The direct path's aiohttp pool, the one HEAD uses there, then its GET pool.
            held_get = getattr(store._transport, "wire", None).get("k", 0, 6 * MiB - 1)
            await held_get.__aenter__()  # pins the only connection of the GET pool
            try:
                with pytest.raises(StoreUnavailable):
                    await store.get_async("k")
            finally:
                await held_get.__aexit__(None, None, None)
            holding = getattr(store._transport, "wire", None)._request("GET", "GET", "k", {"Range": f"bytes=0-{6 * MiB - 1}"})
            await holding.__aenter__()  # pins the only connection
            release = functools.partial(holding.__aexit__, None, None, None)
        else:
            held = await client.get_object(Bucket=store.bucket, Key="k")  # pins the only connection

            async def release() -> None:
                held["Body"].close()
        try:
            with pytest.raises(StoreUnavailable):
                await store.head_async("k")
        finally:
            await release()
        return await store.head_async("k") is not None and len(await store.get_async("k")) == 6 * MiB

    assert store.run(scenario(), timeout=30) is True


def test_failed_part_stops_the_other_parts(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """A 3-range blob, two permits: the first answer holds one until its body is read,
    range 2 the other (asked with the first's head), so range 3 goes out only once the
    caller placed its buffer; when it fails, get_async must not return while another
    range still goes on to write into the buffer."""
    store = make_store(fault_proxy.endpoint_url, max_concurrency=2, max_attempts=1,
                       multipart_part_bytes=5 * MiB, multipart_threshold_bytes=64 * MiB, get_range_bytes=5 * MiB)
    data = os.urandom(12 * MiB)
    store.run(store.put_async("k", data), timeout=60)
    buffers: list[memoryview] = []

    def allocate(nbytes: int) -> memoryview:
        # Called once the first range's answer is in: fail the next GET (range 3).
        fault_proxy.error_next(1, 400, methods=["GET"])
        buffers.append(memoryview(bytearray(nbytes)))
        return buffers[0]

    with pytest.raises(StoreError) as err:
        store.run(store.get_async("k", allocate=allocate), timeout=30)
    assert err.value.status == 400
    time.sleep(2.0)  # part 3 (2 MiB) would have arrived by now
    assert not any(buffers[0][10 * MiB :]), "part 3 was written after get_async had failed"


def test_probe_ending_in_a_caller_error_does_not_keep_the_breaker_open(
    make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    """Open the breaker with 503s, let it cool down, and let the probe end in the
    caller's allocator raising: the store is healthy, so HEADs must work again."""
    store = make_store(fault_proxy.endpoint_url, max_attempts=1, breaker_threshold=1, breaker_cooldown_s=0.2)
    store.run(store.put_async("k", b"x" * 1000), timeout=30)
    fault_proxy.set_error_rate(1.0, 503)
    with pytest.raises(StoreUnavailable):
        store.run(store.head_async("k"), timeout=30)
    assert store.breaker.is_open
    fault_proxy.clear()
    time.sleep(0.3)  # the cooldown
    with pytest.raises(Refused):
        store.run(store.get_async("k", allocate=_refuse), timeout=30)  # the probe
    deadline = time.monotonic() + 10.0
    while True:
        try:
            assert store.run(store.head_async("k"), timeout=30) is not None
            break
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert not store.breaker.is_open


@pytest.mark.parametrize("lost", [1, 2], ids=["aiohttp-resends", "store-retries"])
def test_a_put_whose_answer_was_lost_is_this_puts_blob(
    make_store: Callable[..., S3Store], fault_proxy: FaultProxy, lost: int
) -> None:
    """The PUT lands and its answer is lost; the resend (aiohttp's own, once, on a pooled
    connection; with two answers lost, the store's retry) meets the blob with a 412. That
    blob is this PUT's own: CREATED and counted as a lost answer, never "another
    producer's" (issue 25 item 6: 3 objects created, blobs_uploaded 2)."""
    store = make_store(fault_proxy.endpoint_url, max_attempts=3)
    store.run(store.head_async("warm"), timeout=20)  # a pooled connection to resend on
    fault_proxy.drop_response_next(lost, ["PUT"])
    data = os.urandom(1000)
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    assert fault_proxy.counters.dropped_responses == lost
    assert store.stats.lost_answer_writes == 1 and store.stats.bytes_uploaded == len(data)
    assert store.stats.retries == lost - 1  # aiohttp's resend is not the store's retry
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_another_writers_blob_stays_already_present_after_a_lost_answer(
    make_store: Callable[..., S3Store], fault_proxy: FaultProxy
) -> None:
    """The key holds another writer's blob, and the 412 that says so is lost: the resend's
    412 is about that writer's blob, not ours."""
    other = make_store()
    assert other.run(other.put_async("k", b"theirs"), timeout=30) is PutOutcome.CREATED
    store = make_store(fault_proxy.endpoint_url)
    store.run(store.head_async("warm"), timeout=20)
    fault_proxy.drop_response_next(1, ["PUT"])
    assert store.run(store.put_async("k", b"ours!!"), timeout=60) is PutOutcome.ALREADY_EXISTS
    assert fault_proxy.counters.dropped_responses == 1
    assert store.stats.lost_answer_writes == 0 and store.stats.bytes_uploaded == 0
