"""The fetcher always reports: every lookup ends in exactly one result whatever the
store does (an item without one would wait forever), and no staging byte or name stays
booked by a lookup that did not stage. Faults come from a real server, a closed
endpoint, a request the store refuses to send, a staging directory removed under the
fetcher and a stopped I/O loop."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ec_s3.blob.codec import BlobExpectation, BlobMeta, encode_blob
from ec_s3.config import ECS3Config
from ec_s3.loop import BackgroundLoop
from ec_s3.store.client import S3Store
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.fetcher import Failed, FetchResult, ItemFetcher, Missing, NoSpace, Present, Staged
from ec_s3.transfer.staging import StagingArea


MiB = 1 << 20


def _results(fetcher: ItemFetcher, n: int, timeout_s: float = 15.0) -> dict[str, FetchResult]:
    out: dict[str, FetchResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out.update(fetcher.drain())
        time.sleep(0.01)
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_head_lookup_reports(make_store: Callable[..., S3Store]) -> None:
    """A HEAD that fails with something other than a store error (the store refuses an
    empty key before sending) used to leave its item without a result forever."""
    store = make_store()
    store.run(store.put_async("k/present", b"x"))
    fetcher = ItemFetcher(store, None, Counters())
    for key in ("", "k/present", "k/missing"):
        fetcher.start(key, None)
    results = _results(fetcher, 3)
    assert set(results) == {"", "k/present", "k/missing"}, f"no result for {({'', 'k/present', 'k/missing'} - set(results))}"
    assert isinstance(results[""], Failed)
    assert results["k/present"] == Present(1) and results["k/missing"] == Missing()


def test_lookups_report_when_the_endpoint_is_closed(make_store: Callable[..., S3Store]) -> None:
    store = make_store(f"http://127.0.0.1:{_closed_port()}", max_attempts=2)
    fetcher = ItemFetcher(store, None, Counters())
    fetcher.start("k/x", None)
    result = _results(fetcher, 1)["k/x"]
    assert isinstance(result, Failed) and result.transient


def test_failed_staging_reports_and_books_nothing(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """The allocator the store calls raises (staging directory removed under us): the
    lookup reports Failed and no staging byte or name stays booked."""
    store = make_store()
    x = torch.ones(64, 128, dtype=torch.bfloat16)
    store.run(store.put_async("k/blob", encode_blob(x, BlobMeta("img", x.dtype, tuple(x.shape), "ns", "p"))))
    area = StagingArea(str(tmp_path), 64 * MiB)
    fetcher = ItemFetcher(store, area, Counters())
    expect = BlobExpectation(identifier="img", namespace="ns")
    shutil.rmtree(area.dir)
    fetcher.start("k/blob", expect)
    assert isinstance(_results(fetcher, 1)["k/blob"], Failed)
    assert area.used == 0 and len(area) == 0
    area.dir.mkdir(mode=0o700)  # the directory is back: the same key stages again
    fetcher.start("k/blob", expect)
    result = _results(fetcher, 1)["k/blob"]
    assert isinstance(result, Staged) and area.used == result.slot.nbytes
    area.close()


def test_lookup_after_the_loop_stopped_reports(make_config: Callable[..., ECS3Config]) -> None:
    loop = BackgroundLoop("test-io")
    store = S3Store(make_config(), loop=loop)
    loop.stop()
    fetcher = ItemFetcher(store, None, Counters())
    fetcher.start("k/x", None)  # must not raise into the scheduler
    assert isinstance(_results(fetcher, 1)["k/x"], Failed)


def test_staged_blob_lands_bit_exact_in_its_slot(tmp_path: Path, make_store: Callable[..., S3Store]) -> None:
    """A multi-part blob fetched into its staging slot (a shared-memory mmap) is
    bit-exact; on the direct path its GETs go through the recv pool, whose kernel
    reads write into the slot's mapping."""
    store = make_store(multipart_part_bytes=5 * MiB, multipart_threshold_bytes=8 * MiB, get_range_bytes=5 * MiB)
    x = torch.randn(6 * MiB // 256, 128).to(torch.bfloat16)  # 12 MiB: three parts
    blob = encode_blob(x, BlobMeta("img", x.dtype, tuple(x.shape), "ns", "p"))
    store.run(store.put_async("k/blob", blob), timeout=60)
    area = StagingArea(str(tmp_path), 64 * MiB)
    fetcher = ItemFetcher(store, area, Counters())
    fetcher.start("k/blob", BlobExpectation(identifier="img", namespace="ns"))
    result = _results(fetcher, 1, timeout_s=60)["k/blob"]
    assert isinstance(result, Staged), result
    with open(result.slot.path, "rb") as f:
        assert f.read() == blob
    wire = getattr(store._transport, "wire", None)
    assert wire is not None and wire.recv_pool is not None
    assert wire.recv_pool.opened >= 1 and wire.recv_pool.in_use == 0
    area.close()


def test_a_full_staging_area_is_no_space_and_leaves_no_connection_held(
    tmp_path: Path, make_store: Callable[..., S3Store]
) -> None:
    """The size comes first, the slot second: a blob larger than the staging area is
    NoSpace before a byte of it is read, its answer released unread (8 MiB is more
    than the socket buffers hold, so an unread body would pin its connection), and
    nothing stays booked."""
    store = make_store(max_pool_connections=1)
    x = torch.randn(4 * MiB // 128, 128).to(torch.bfloat16)  # 8 MiB
    blob = encode_blob(x, BlobMeta("img", x.dtype, tuple(x.shape), "ns", "p"))
    store.run(store.put_async("k/blob", blob), timeout=60)
    small, counters = StagingArea(str(tmp_path / "small"), 4 * MiB), Counters()
    fetcher = ItemFetcher(store, small, counters)
    expect = BlobExpectation(identifier="img", namespace="ns")
    for _ in range(3):  # more than the pool
        fetcher.start("k/blob", expect)
        assert isinstance(_results(fetcher, 1, timeout_s=30)["k/blob"], NoSpace)
    assert small.used == 0 and len(small) == 0
    assert counters.get("staging_no_space") == 3
    big = StagingArea(str(tmp_path / "big"), 64 * MiB)
    fetcher = ItemFetcher(store, big, Counters())
    fetcher.start("k/blob", expect)
    result = _results(fetcher, 1, timeout_s=30)["k/blob"]
    assert isinstance(result, Staged), result
    small.close()
    big.close()
