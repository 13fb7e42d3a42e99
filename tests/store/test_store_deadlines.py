"""A server that trickles its answers cannot hold a request, nor the store's request permits, forever.

``read_timeout_s`` bounds each silence; a body sent a byte at a time never trips it.
``request_timeout_s`` bounds each attempt as a whole and each wait for one of the
``max_concurrency`` permits (store/permits.py). Against a scripted raw
server (tests/support/scripted_http.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest

from ec_s3.config import ConfigError
from ec_s3.store.client import S3Store
from ec_s3.store.errors import StoreBusy, StoreError, StoreTimeout
from ec_s3.store.permits import RequestPermits
from tests.support.scripted_http import ScriptedHTTP

SIZE = 100


def _trickle(sock: socket.socket) -> None:
    """A well-formed 206 whose body comes one byte per 0.2 s (20 s in all)."""
    sock.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-%d/%d\r\nContent-Length: %d\r\n\r\n"
                 % (SIZE - 1, SIZE, SIZE))
    for _ in range(SIZE):
        time.sleep(0.2)
        sock.sendall(b"x")


def test_a_trickled_body_times_out_as_a_whole(make_store: Callable[..., S3Store]) -> None:
    with ScriptedHTTP(lambda n, head: _trickle) as server:
        store = make_store(server.url, max_attempts=1, read_timeout_s=1.0, request_timeout_s=1.5)
        started = time.monotonic()
        with pytest.raises(StoreTimeout):
            store.run(store.get_async("k"), timeout=30)
        assert time.monotonic() - started < 6.0  # 1.5 s (+ the client's first build); not 20 s
        assert store.stats.failures == 1 and store.breaker.failures == 1  # counted as any last attempt


def test_waiting_for_a_permit_is_bounded(make_store: Callable[..., S3Store]) -> None:
    """One permit, three trickled GETs: the first holds the permit until its deadline;
    the others wait at most that long, and at least one of them gets StoreBusy."""
    with ScriptedHTTP(lambda n, head: _trickle) as server:
        store = make_store(server.url, max_attempts=1, max_concurrency=1, read_timeout_s=1.0, request_timeout_s=1.0)
        started = time.monotonic()
        futures = [store.submit(store.get_async(f"k{i}")) for i in range(3)]
        errors: list[BaseException] = []
        for future in futures:
            with pytest.raises(StoreError) as caught:
                future.result(timeout=30)
            errors.append(caught.value)
        assert time.monotonic() - started < 8.0  # not 3 x 20 s
        assert all(isinstance(e, (StoreTimeout, StoreBusy)) for e in errors), errors
        assert any(isinstance(e, StoreBusy) for e in errors), errors
        assert all(e.transient for e in errors)


def test_request_timeout_s_is_validated(make_config: Callable[..., object]) -> None:
    with pytest.raises(ConfigError, match="request_timeout_s"):
        make_config(request_timeout_s=0)


def test_permits_are_released_on_every_way_out() -> None:
    async def scenario() -> None:
        permits = RequestPermits(1, 0.2)
        with pytest.raises(StoreTimeout):
            async with permits.hold("GET", "k"):
                await asyncio.sleep(5)
        with pytest.raises(ValueError):
            async with permits.hold("GET", "k"):
                raise ValueError("the caller's")
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with permits.hold("GET", "k"):
            assert loop.time() - started < 0.1  # free again at once

    asyncio.run(scenario())


# -- issue 24 item 3: a deadline ends typed in the caller's task, never as its cancellation ----
MiB = 1 << 20
PART = 5 * MiB
# One range (under a part), and two (a part plus a header's worth, plus 100 bytes).
SIZES = {1: SIZE, 2: PART + 64 * 1024 + 100}


def _first_trickled(data: bytes, trickled: int) -> Callable[[int, bytes], object]:
    """Serves ``data``; the first ``trickled`` answers to a range from byte 0 send their
    head and then one byte per 0.2 s (a 206 that never ends in time)."""
    from tests.support.scripted_http import header, serve_range

    count = [0]

    def script(n: int, head: bytes) -> object:
        whole = serve_range(head, data)
        if not (header(head, b"Range") or b"").startswith(b"bytes=0-") or count[0] >= trickled:
            return whole
        count[0] += 1
        body_at = whole.index(b"\r\n\r\n") + 4

        def send(sock: socket.socket) -> None:
            sock.sendall(whole[:body_at])
            for i in range(body_at, len(whole)):
                time.sleep(0.2)
                sock.sendall(whole[i : i + 1])

        return send

    return script


@pytest.mark.parametrize("ranges", [1, 2])
def test_a_slow_first_body_is_retried_not_a_cancel_of_the_caller(
    make_store: Callable[..., S3Store], ranges: int
) -> None:
    """Failed before (both paths, 1 and 2 ranges): the permit's deadline, entered in the
    caller's task when the first answer was opened and left in another task when its
    body was read, cancelled the caller: a bare CancelledError with max_attempts >= 2."""
    data = bytes(range(256)) * (SIZES[ranges] // 256) + bytes(SIZES[ranges] % 256)
    with ScriptedHTTP(_first_trickled(data, 1)) as server:
        store = make_store(server.url, max_attempts=2, read_timeout_s=1.0, request_timeout_s=1.0,
                           get_range_bytes=PART)
        got = store.run(store.get_async("k"), timeout=30)
        assert bytes(got) == data
        assert store.stats.retries == 1


@pytest.mark.parametrize("ranges", [1, 2])
def test_a_first_body_slow_on_every_attempt_is_a_store_timeout(
    make_store: Callable[..., S3Store], ranges: int
) -> None:
    data = bytes(SIZES[ranges])
    with ScriptedHTTP(_first_trickled(data, 10)) as server:
        store = make_store(server.url, max_attempts=2, read_timeout_s=1.0, request_timeout_s=1.0,
                           get_range_bytes=PART)
        started = time.monotonic()
        with pytest.raises(StoreTimeout):
            store.run(store.get_async("k"), timeout=30)
        assert time.monotonic() - started < 10.0


def test_the_callers_own_await_between_open_and_read_is_not_cancelled(make_store: Callable[..., S3Store]) -> None:
    """Failed before (both paths): the caller's own sleep between ``open_async`` and
    ``read_into``, longer than request_timeout_s, was cancelled by the permit's deadline.
    Now the attempt that outlived its deadline is retried when the caller reads."""
    from tests.support.scripted_http import serve_range

    data = bytes(range(100))
    with ScriptedHTTP(lambda n, head: serve_range(head, data)) as server:
        store = make_store(server.url, read_timeout_s=1.0, request_timeout_s=0.5)

        async def caller() -> tuple[bytes, bool]:
            async with store.open_async("k") as download:
                slept = False
                await asyncio.sleep(0.8)
                slept = True
                out = memoryview(bytearray(download.size))
                await download.read_into(out)
            return bytes(out), slept

        assert store.run(caller(), timeout=30) == (data, True)
