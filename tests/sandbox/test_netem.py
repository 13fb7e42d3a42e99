"""The network emulator (ec_s3/sandbox/netem.py) really delays and caps: transfers
through it measured against its profile, with wide margins (a shared 2-core host).

Its upstream here is a plain TCP server that answers ``N\\n`` with N bytes, so the
numbers are the proxy's, not an S3 server's; bench/transfer.py measures S3 through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import contextlib

import pytest

from ec_s3.sandbox.netem import PROFILES, LinkProfile, NetEm, limit_s

pytestmark = pytest.mark.timeout(120)

MB = 1_000_000


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    pattern = bytes(range(256)) * 4096  # 1 MiB
    while line := await reader.readline():
        n = int(line)
        while n:
            writer.write(pattern[: min(n, len(pattern))])
            n -= min(n, len(pattern))
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _server() -> AsyncIterator[str]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _exchanges(port: int, sizes: list[int]) -> list[tuple[float, float, bytes]]:
    """On one connection, per size: (seconds to the first byte, seconds to the last, the bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    try:
        for size in sizes:
            started = time.monotonic()
            writer.write(b"%d\n" % size)
            await writer.drain()
            first = await reader.readexactly(1)
            first_at = time.monotonic() - started
            rest = await reader.readexactly(size - 1)
            out.append((first_at, time.monotonic() - started, first + rest))
    finally:
        writer.close()
    return out


def test_first_byte_and_new_connection_round_trip_per_request() -> None:
    profile = LinkProfile("t", first_byte_s=0.06, rtt_s=0.04)

    async def run() -> list[tuple[float, float, bytes]]:
        async with _server() as url:
            with NetEm(url, profile) as link:
                return await _exchanges(link.port, [10, 10, 10])

    (new, _, _), (again, _, data), (third, _, _) = asyncio.run(run())
    # (uvloop's timers wake up to a millisecond early: the lower bounds allow 5 ms)
    assert 0.095 <= new < 0.5  # first byte + one round trip for the handshake
    assert 0.055 <= again < 0.4 and 0.055 <= third < 0.4  # each request on the kept-alive connection waits again
    assert data == bytes(range(10))  # relayed intact


def test_a_connection_is_capped_at_its_rate_and_all_at_the_nics() -> None:
    profile = LinkProfile("t", first_byte_s=0.01, conn_bytes_per_s=40 * MB, nic_bytes_per_s=60 * MB)
    size = 12 * MB

    async def run() -> tuple[float, float]:
        async with _server() as url:
            with NetEm(url, profile) as link:
                await _exchanges(link.port, [1])  # the process is up and warm
                (_, one, data), = await _exchanges(link.port, [size])
                assert data[:512] == bytes(range(256)) * 2
                started = time.monotonic()
                await asyncio.gather(*(_exchanges(link.port, [size]) for _ in range(3)))
                return one, time.monotonic() - started

    one, three = asyncio.run(run())
    assert size / one <= 40 * MB * 1.15  # no faster than the connection's cap
    assert size / one >= 40 * MB * 0.4  # and near it (wide: a busy host slows the proxy)
    assert 3 * size / three <= 60 * MB * 1.15  # three connections share the NIC's rate
    assert three >= 3 * size / (60 * MB) * 0.85


def test_a_slow_tail_stalls_its_fraction_of_answers() -> None:
    profile = LinkProfile("t").with_tail(1.0, 0.3)

    async def run() -> list[tuple[float, float, bytes]]:
        async with _server() as url:
            with NetEm(url, profile, seed=1) as link:
                return await _exchanges(link.port, [5, 5])

    assert all(0.295 <= first < 1.5 for first, _, _ in asyncio.run(run()))


def test_a_stalled_answer_holds_up_its_own_connection_only() -> None:
    """A stall is the server's (S3's slow tail), not the link's: while one answer waits,
    another connection's answer goes at its own pace. The stalled first byte once booked
    the shared NIC from its due time on, so every connection waited for the stall."""
    profile = LinkProfile("t", first_byte_s=0.01, nic_bytes_per_s=100 * MB).with_tail(0.5, 1.5)

    async def run() -> tuple[float, float]:
        async with _server() as url:
            # seed 1 draws 0.13 (stalled) then 0.85 (not): the first answer is the stalled one
            with NetEm(url, profile, seed=1) as link:
                stalled = asyncio.ensure_future(_exchanges(link.port, [1000]))
                await asyncio.sleep(0.3)  # the stalled answer's first byte is due, not sent
                (other, _, data), = await _exchanges(link.port, [1000])
                assert data == (bytes(range(256)) * 4)[:1000]
                (held, _, _), = await stalled
                return held, other

    held, other = asyncio.run(run())
    assert held >= 1.45  # stalled
    assert other < 0.6, f"a connection waited {other:.2f}s for another's stalled answer"


def test_profiles_and_the_limit() -> None:
    standard = PROFILES["standard"]
    assert (standard.first_byte_s, standard.conn_bytes_per_s, standard.nic_bytes_per_s) == (0.020, 90e6, 1.25e9)
    assert (PROFILES["express"].first_byte_s, PROFILES["express"].conn_bytes_per_s) == (0.004, 200e6)
    assert limit_s(standard, 10 * (1 << 20)) == pytest.approx(0.020 + 10 * (1 << 20) / 1.25e9)
    assert limit_s(PROFILES["loopback"], 1 << 30) == 0.0
