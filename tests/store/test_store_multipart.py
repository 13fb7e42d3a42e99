"""Multipart uploads against SeaweedFS, with a fault proxy where the server must misbehave.

Complete's 409 starts a new upload (never the same upload id again); a NoSuchUpload is
decided by a HEAD (present: stored, as after a 412; absent: one new upload); aborts are
retried in the background, bounded, without holding up the caller; incomplete uploads
are listed and aborted by prefix (``ec-s3 gc --uploads`` builds on that).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ec_s3.store.client import PutOutcome, S3Store, StoreError, StoreUnavailable
from ec_s3.store.multipart import IncompleteUpload, abort_upload_async, list_uploads_async
from support.faultproxy import FaultProxy

MiB = 1 << 20
# 6 MiB at 5 MiB parts: a two-part upload, the smallest the server accepts.
SMALL_MULTIPART = {"multipart_part_bytes": 5 * MiB, "multipart_threshold_bytes": 5 * MiB}


def _store(make_store: Callable[..., S3Store], proxy: FaultProxy, **overrides: Any) -> S3Store:
    return make_store(proxy.endpoint_url, **{**SMALL_MULTIPART, **overrides})


def _upload_ids(proxy: FaultProxy, method: str) -> list[str]:
    """The upload id of every request of ``method`` that carried one, in order."""
    ids = []
    for seen_method, target in list(proxy.seen):
        query = parse_qs(urlsplit(target).query)
        if seen_method == method and "uploadId" in query:
            ids.append(query["uploadId"][0])
    return ids


def _creates(proxy: FaultProxy) -> int:
    return sum(1 for m, t in list(proxy.seen) if m == "POST" and "uploads" in parse_qs(urlsplit(t).query, keep_blank_values=True))


def _uploads(store: S3Store, prefix: str = "") -> list[IncompleteUpload]:
    async def collect() -> list[IncompleteUpload]:
        return [u async for u in list_uploads_async(store, prefix)]

    return store.run(collect(), timeout=30)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_conflict_at_complete_starts_a_new_upload(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """409 ConditionalRequestConflict: the second Complete names a new upload id, and
    the first upload is aborted (it was retried with the same id before)."""
    store = _store(make_store, fault_proxy)
    data = os.urandom(6 * MiB)
    fault_proxy.error_next(1, 409, ["POST"], target_contains="uploadId=", code="ConditionalRequestConflict")
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    completes = _upload_ids(fault_proxy, "POST")
    assert len(completes) == 2 and completes[0] != completes[1] and _creates(fault_proxy) == 2
    _wait_for(lambda: completes[0] in _upload_ids(fault_proxy, "DELETE"))
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    assert _uploads(store) == []


def test_no_such_upload_with_the_object_present_is_stored(make_store: Callable[..., S3Store],
                                                          fault_proxy: FaultProxy) -> None:
    """A concurrent writer won (its object is there) and our upload is gone: the blob is
    stored, as after a 412; no second upload. It failed as ObjectNotFound before."""
    store = _store(make_store, fault_proxy)
    winner = os.urandom(6 * MiB)
    assert store.run(store.put_async("k", winner), timeout=60) is PutOutcome.CREATED
    fault_proxy.seen.clear()
    # The pre-upload HEAD misses (the race window): the server's 200 becomes a 404.
    fault_proxy.rewrite_answer_next(1, 200, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", ["HEAD"])
    fault_proxy.error_next(1, 404, ["POST"], target_contains="uploadId=", code="NoSuchUpload")
    assert store.run(store.put_async("k", os.urandom(6 * MiB)), timeout=60) is PutOutcome.ALREADY_EXISTS
    assert _creates(fault_proxy) == 1
    assert bytes(store.run(store.get_async("k"), timeout=30)) == winner
    _wait_for(lambda: _uploads(store) == [])


def test_no_such_upload_with_the_object_absent_restarts_once(make_store: Callable[..., S3Store],
                                                             fault_proxy: FaultProxy) -> None:
    """Our upload was aborted under us (a gc) and nothing is stored: one new upload."""
    store = _store(make_store, fault_proxy)
    data = os.urandom(6 * MiB)
    fault_proxy.error_next(1, 404, ["POST"], target_contains="uploadId=", code="NoSuchUpload")
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    assert _creates(fault_proxy) == 2
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_a_lost_answer_to_complete_is_not_a_failure(make_store: Callable[..., S3Store],
                                                    fault_proxy: FaultProxy) -> None:
    """Complete succeeded but its answer was lost: the retry meets the upload gone (or
    completed); the object is there and carries this upload's write token, so the blob
    counts as created by this upload (not failed, not another writer's)."""
    store = _store(make_store, fault_proxy)
    data = os.urandom(6 * MiB)
    fault_proxy.drop_response_next(1, ["POST"], target_contains="uploadId=")
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    assert store.stats.lost_answer_writes == 1 and store.stats.bytes_uploaded == len(data)
    assert fault_proxy.counters.dropped_responses == 1 and _creates(fault_proxy) == 1
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    _wait_for(lambda: _uploads(store) == [])


def test_conflicts_twice_give_up_as_transient(make_store: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """Restarted once only: a second conflict is a transient failure (the spool retries
    later), and neither upload is left behind."""
    store = _store(make_store, fault_proxy)
    fault_proxy.error_next(2, 409, ["POST"], target_contains="uploadId=", code="ConditionalRequestConflict")
    with pytest.raises(StoreUnavailable) as info:
        store.run(store.put_async("k", os.urandom(6 * MiB)), timeout=60)
    assert info.value.op == "CompleteMultipartUpload" and _creates(fault_proxy) == 2
    assert store.run(store.head_async("k"), timeout=30) is None
    _wait_for(lambda: _uploads(store) == [])


def test_failed_aborts_are_retried_without_holding_the_caller(make_store: Callable[..., S3Store],
                                                              fault_proxy: FaultProxy) -> None:
    """The upload fails (a 400 at Complete); its abort meets a stalled server, then 500s.
    The caller gets its error at once; the abort keeps trying and the upload goes.
    Before: one abort attempt, awaited by the caller, errors swallowed: the upload stayed."""
    store = _store(make_store, fault_proxy, max_attempts=1, retry_max_delay_s=0.05, read_timeout_s=20.0)
    fault_proxy.error_next(1, 400, ["POST"], target_contains="uploadId=")
    fault_proxy.set_stall(True, ["DELETE"])
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.run(store.put_async("k", os.urandom(6 * MiB)), timeout=60)
    # Returned while the abort is still held (the old code awaited it up to read_timeout_s).
    assert info.value.status == 400 and time.monotonic() - t0 < 15.0
    fault_proxy.wait_until(lambda c: c.held_now == 1)
    assert len(_uploads(store)) == 1
    fault_proxy.error_next(1, 500, ["DELETE"], target_contains="uploadId=")
    fault_proxy.set_stall(False)  # the held abort is answered 500, the next round succeeds
    _wait_for(lambda: _uploads(store) == [])
    assert store.stats.abandoned_uploads == 0


def test_an_abort_that_keeps_failing_is_counted_and_left_to_gc(make_store: Callable[..., S3Store],
                                                               fault_proxy: FaultProxy) -> None:
    store = _store(make_store, fault_proxy, max_attempts=1, retry_max_delay_s=0.01)
    fault_proxy.error_next(1, 400, ["POST"], target_contains="uploadId=")
    fault_proxy.set_error_rate(1.0, 503, ["DELETE"])
    with pytest.raises(StoreError):
        store.run(store.put_async("k", os.urandom(6 * MiB)), timeout=60)
    _wait_for(lambda: store.stats.abandoned_uploads == 1)
    assert len(_upload_ids(fault_proxy, "DELETE")) == 3  # _ABORT_ROUNDS rounds of max_attempts=1
    (left,) = _uploads(store)
    fault_proxy.clear()
    store.run(abort_upload_async(store, left.key, left.upload_id), timeout=30)
    store.run(abort_upload_async(store, left.key, left.upload_id), timeout=30)  # gone already: no error
    assert _uploads(store) == []


def test_list_uploads_by_prefix_and_pages(make_store: Callable[..., S3Store]) -> None:
    store = make_store()

    async def start(key: str) -> str:
        client = await store._get_client()
        resp = await client.create_multipart_upload(Bucket=store.bucket, Key=key)
        return str(resp["UploadId"])

    ids = {store.run(start(f"p/{i}"), timeout=30) for i in range(3)}
    store.run(start("other/x"), timeout=30)
    got = _uploads(store, "p/")
    assert {u.upload_id for u in got} == ids and all(u.key.startswith("p/") for u in got)
    assert all(abs(time.time() - u.initiated) < 300 for u in got)
