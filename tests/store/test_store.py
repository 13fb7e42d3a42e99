"""S3Store against a real S3 server, with faults injected by a proxy in between."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import AccessDenied, PutOutcome, S3Store, StoreClosed, StoreUnavailable
from support.faultproxy import FaultProxy


MiB = 1 << 20


def _data(n: int, seed: int = 0) -> bytearray:
    return bytearray(os.urandom(n)) if seed == 0 else bytearray((seed % 251).to_bytes(1, "little") * n)


@pytest.mark.parametrize("size", [1024, 8 * MiB, 40 * MiB])
def test_round_trip(make_store: Callable[..., S3Store], fault_proxy: FaultProxy, size: int) -> None:
    """1 KB and 8 MB go as one PUT; 40 MB as a multipart upload. A GET of unknown size
    asks one range of get_range_bytes (and a header's worth), then the rest in parallel
    ranges; of a known size, every range at once (at most max_concurrency)."""
    store = make_store(fault_proxy.endpoint_url)
    data = _data(size)
    before = fault_proxy.counters.requests
    assert store.run(store.put_async("blob", data), timeout=60) is PutOutcome.CREATED
    puts = fault_proxy.counters.requests - before
    parts = -(-size // (8 * MiB))
    # multipart: HEAD + create + 5 parts + complete; single: one PUT
    assert puts == (1 if size < 16 * MiB else parts + 3)
    before = fault_proxy.counters.requests
    got = store.run(store.get_async("blob"), timeout=60)
    step, header = store.config.get_range_bytes, 64 * 1024
    rest = max(0, size - step - header)
    assert fault_proxy.counters.requests - before == 1 + min(16, -(-rest // step))
    assert bytes(got) == bytes(data)
    before = fault_proxy.counters.requests
    got = store.run(store.get_async("blob", expected_size=size), timeout=60)
    assert fault_proxy.counters.requests - before == max(1, min(16, -(-(size - header) // step)))
    assert bytes(got) == bytes(data)
    info = store.run(store.head_async("blob"))
    assert info is not None and info.size == size


def test_head_missing_is_none(make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    assert store.run(store.head_async("no/such/key")) is None


@pytest.mark.parametrize("size", [4096, 20 * MiB])
def test_conditional_put_race_one_blob(make_store: Callable[..., S3Store], size: int) -> None:
    """Two concurrent puts of one key: both report success and one blob survives."""
    a, b = make_store(), make_store()
    da, db = _data(size, 1), _data(size, 2)
    fa = a.submit(a.put_async("race", da))
    fb = b.submit(b.put_async("race", db))
    outcomes = {fa.result(60), fb.result(60)}
    assert outcomes <= {PutOutcome.CREATED, PutOutcome.ALREADY_EXISTS}
    got = bytes(a.run(a.get_async("race"), timeout=60))
    assert got in (bytes(da), bytes(db))
    # A later put never replaces an immutable blob.
    assert a.run(a.put_async("race", _data(size, 3))) is PutOutcome.ALREADY_EXISTS
    assert bytes(a.run(a.get_async("race"))) == got


def test_retries_after_503_and_resets(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url, max_attempts=4)
    fault_proxy.error_next(2, 503, methods=["PUT"])
    assert store.run(store.put_async("k", _data(1000)), timeout=30) is PutOutcome.CREATED
    assert store.stats.retries == 2 and fault_proxy.counters.errors == 2
    fault_proxy.reset_next(2, methods=["GET"])
    assert len(store.run(store.get_async("k"), timeout=30)) == 1000
    # aiohttp itself re-sends once on a pooled connection that dropped, so a reset
    # costs at least one of our retries per request, not necessarily one each.
    assert fault_proxy.counters.resets == 2 and store.stats.retries >= 3


def test_truncated_body_is_retried(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url)
    data = _data(MiB)
    store.run(store.put_async("k", data), timeout=30)
    fault_proxy.truncate_next(1, methods=["GET"])
    assert bytes(store.run(store.get_async("k"), timeout=30)) == bytes(data)
    assert store.stats.retries >= 1 and fault_proxy.counters.truncated == 1


def test_attempts_are_bounded_by_max_attempts(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url, max_attempts=3)
    fault_proxy.set_error_rate(1.0, 503)
    with pytest.raises(StoreUnavailable, match="503"):
        store.run(store.head_async("k"), timeout=30)
    assert fault_proxy.counters.errors == 3 and store.stats.retries == 2


def test_no_retry_on_403(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url, max_attempts=4)
    fault_proxy.error_next(5, 403)
    with pytest.raises(AccessDenied):
        store.run(store.put_async("k", _data(10)), timeout=30)
    assert fault_proxy.counters.errors == 1 and store.stats.retries == 0


def test_wrong_credentials_are_access_denied(make_store: Callable[..., S3Store]) -> None:
    store = make_store(secret_access_key="definitely-wrong-secret", max_attempts=4)
    with pytest.raises(AccessDenied, match="credentials"):
        store.run(store.head_async("k"), timeout=30)
    assert store.stats.retries == 0


def test_stalled_server_times_out(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url, read_timeout_s=0.3, max_attempts=2)
    fault_proxy.set_stall(True)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="Timeout"):
        store.run(store.head_async("k"), timeout=30)
    elapsed = time.monotonic() - started
    fault_proxy.set_stall(False)
    assert 0.5 <= elapsed < 5.0, elapsed


def test_close_drains_pending_work(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url)
    fault_proxy.set_latency(0.3)
    futures = [store.submit(store.put_async(f"k{i}", _data(2000))) for i in range(10)]
    store.close(timeout=20)
    assert all(f.result(0) is PutOutcome.CREATED for f in futures)
    with pytest.raises(StoreClosed):
        store.submit(store.head_async("k0"))
    fault_proxy.set_latency(0)
    check = make_store()
    assert all(check.run(check.head_async(f"k{i}")) is not None for i in range(10))


def test_close_cancels_stuck_work_within_timeout(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = make_store(fault_proxy.endpoint_url, read_timeout_s=30)
    fault_proxy.set_stall(True)
    future = store.submit(store.put_async("stuck", _data(100)))
    time.sleep(0.2)
    started = time.monotonic()
    store.close(timeout=0.5)
    assert time.monotonic() - started < 5
    fault_proxy.set_stall(False)
    with pytest.raises((concurrent.futures.CancelledError, StoreUnavailable)):
        future.result(5)


def test_list_and_delete(make_store: Callable[..., S3Store]) -> None:
    store = make_store()
    for i in range(5):
        store.run(store.put_async(f"p/a/{i}", _data(10)))
    store.run(store.put_async("p/b/0", _data(10)))

    async def listing(prefix: str) -> list[str]:
        return [o.key async for o in store.list_async(prefix)]

    assert sorted(store.run(listing("p/a/"))) == [f"p/a/{i}" for i in range(5)]
    assert store.run(store.delete_many_async([f"p/a/{i}" for i in range(3)])) == 3
    store.run(store.delete_async("p/a/3"))
    assert store.run(listing("p/")) == ["p/a/4", "p/b/0"]
