"""The host buffer pool holds at most its capacity, lent out or idle, reuses its
buffers (one allocation per buffer, not per blob), makes room by freeing idle buffers
of other sizes, and makes a waiting caller wait only while everything is lent out."""

from __future__ import annotations

import threading

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_s3.transfer.hostpool import HostBufferPool

KiB, MiB = 1 << 10, 1 << 20


def _counting_pool(capacity: int, **kw: object) -> tuple[HostBufferPool, list[int]]:
    sizes: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return HostBufferPool(capacity, allocate=allocate, **kw), sizes  # type: ignore[arg-type]


def test_class_sizes_cover_the_request_with_little_rounding() -> None:
    plain, pinned = HostBufferPool(MiB), HostBufferPool(MiB, pinned=True)
    for n in [1, 64 * KiB, 64 * KiB + 1, 300 * KiB, MiB - 1, MiB, MiB + 1, 8 * MiB + 1500, 33_554_433]:
        size = plain.class_size(n)
        assert size >= n and (n <= 64 * KiB or size <= n * 1.0625)
        p = pinned.class_size(n)
        assert p >= n and p & (p - 1) == 0  # what torch's pinned allocator actually pins


def test_buffers_are_allocated_once_and_reused() -> None:
    pool, sizes = _counting_pool(4 * MiB)
    for _ in range(50):
        bufs = [pool.try_acquire(900 * KiB) for _ in range(3)]
        assert all(b is not None for b in bufs)
        for b in bufs:
            pool.release(b)  # type: ignore[arg-type]
    assert pool.allocations == len(sizes) == 3
    assert pool.used == 0 and pool.held == pool.peak == 3 * pool.class_size(900 * KiB)


def test_full_pool_refuses_then_waits_for_a_release() -> None:
    pool, _ = _counting_pool(MiB)
    a = pool.try_acquire(600 * KiB)
    assert a is not None
    assert pool.try_acquire(600 * KiB) is None
    assert pool.acquire(600 * KiB, timeout=0.05) is None
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(600 * KiB, timeout=10)))
    waiter.start()
    pool.release(a)
    waiter.join(10)
    assert got and got[0] is a  # the same buffer, reused
    assert pool.allocations == 1


def test_idle_buffers_of_another_size_are_freed_to_make_room() -> None:
    pool, sizes = _counting_pool(MiB)
    small = [pool.try_acquire(200 * KiB) for _ in range(4)]
    for b in small:
        pool.release(b)  # type: ignore[arg-type]
    big = pool.try_acquire(900 * KiB)
    assert big is not None  # 800 KiB idle + 900 KiB > 1 MiB: only evicting made room
    assert pool.held <= MiB and pool.peak <= MiB


def test_release_and_discard_count_once() -> None:
    pool, _ = _counting_pool(MiB)
    a, b = pool.try_acquire(100 * KiB), pool.try_acquire(100 * KiB)
    assert a is not None and b is not None
    pool.release(a)
    pool.release(a)
    pool.discard(b)  # something may still write into it: never lent again
    pool.discard(b)
    assert pool.used == 0 and pool.held == pool.class_size(100 * KiB)
    pool.clear()
    assert pool.held == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700 * KiB)), max_size=60))
def test_the_pool_never_holds_more_than_its_capacity(ops: list[tuple[bool, int]]) -> None:
    pool, _ = _counting_pool(MiB)
    lent = []
    for give_back, n in ops:
        if give_back and lent:
            pool.release(lent.pop(0))
        else:
            buf = pool.try_acquire(n)
            if buf is not None:
                assert buf.nbytes >= n
                lent.append(buf)
        assert pool.used <= pool.held <= pool.capacity
        assert pool.used == sum(b.nbytes for b in lent)
    assert pool.peak <= MiB
