"""A server that trickles its answers cannot hold a request, nor the store's request permits, forever.

``read_timeout_s`` bounds each silence; a body sent a byte at a time never trips it.
``request_timeout_s`` bounds each attempt as a whole and each wait for one of the
``max_concurrency`` permits (store/permits.py). Both data paths, against a scripted raw
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


def test_a_trickled_body_times_out_as_a_whole(path_store: Callable[..., S3Store]) -> None:
    with ScriptedHTTP(lambda n, head: _trickle) as server:
        store = path_store(server.url, max_attempts=1, read_timeout_s=1.0, request_timeout_s=1.5)
        started = time.monotonic()
        with pytest.raises(StoreTimeout):
            store.run(store.get_async("k"), timeout=30)
        assert time.monotonic() - started < 6.0  # 1.5 s (+ the client's first build); not 20 s
        assert store.stats.failures == 1 and store.breaker.failures == 1  # counted as any last attempt


def test_waiting_for_a_permit_is_bounded(path_store: Callable[..., S3Store]) -> None:
    """One permit, three trickled GETs: the first holds the permit until its deadline;
    the others wait at most that long, and at least one of them gets StoreBusy."""
    with ScriptedHTTP(lambda n, head: _trickle) as server:
        store = path_store(server.url, max_attempts=1, max_concurrency=1, read_timeout_s=1.0, request_timeout_s=1.0)
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
