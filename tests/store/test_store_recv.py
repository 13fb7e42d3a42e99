"""store/recv.py's framing and pool, against a raw socket server answering canned bytes.

The S3 server and the fault proxy only ever send well-formed answers with one
Content-Length; these are the answers they cannot send (chunked, no or two lengths, a
garbled status line, an endless head, extra bytes after the body, a server that goes
quiet mid-body). Each must fail typed, close its connection (never hand it to the next
GET) and leave the pool as it was. The store-level behaviour against the real server is
in tests/store/test_store_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from ec_s3.store.errors import StoreTimeout, StoreUnavailable, StoreUnreachable
from ec_s3.store.recv import RecvPool

OK_BODY = b"0123456789" * 100
OK = b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\nETag: \"e\"\r\n\r\n" + OK_BODY


class CannedServer:
    """Answers the n-th request with ``answers[n]`` (bytes, or a callable that writes
    on the transport); counts connections. Requests are read up to their blank line."""

    def __init__(self, answers: list[bytes | Callable[[asyncio.StreamWriter], object]]) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                if callable(answer):
                    result = answer(writer)
                    if asyncio.iscoroutine(result):
                        await result
                else:
                    writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(answers: list[bytes | Callable[[asyncio.StreamWriter], object]], **pool_kw: float) -> AsyncIterator[tuple[CannedServer, RecvPool]]:
    canned = CannedServer(answers)
    server = await asyncio.start_server(canned.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    kw = {"limit": 2, "connect_timeout_s": 1.0, "read_timeout_s": 1.0, "keepalive_s": 30.0, **pool_kw}
    pool = RecvPool(f"http://127.0.0.1:{port}/b-1/", **kw)  # type: ignore[arg-type]
    try:
        yield canned, pool
    finally:
        await pool.close()
        server.close()
        for writer in canned.writers:
            writer.transport.abort()
        await server.wait_closed()


async def fetch(pool: RecvPool, size: int = 1000) -> bytes:
    out = bytearray(size)
    async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as answer:
        assert answer.status in (200, 206)
        await answer.read_into(memoryview(out))
    return bytes(out)


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_keep_alive_reuses_one_connection() -> None:
    async def scenario() -> None:
        async with serving([OK]) as (canned, pool):
            for _ in range(5):
                assert await fetch(pool) == OK_BODY
            assert (canned.connections, pool.opened, pool.in_use, pool.idle) == (1, 1, 0, 1)
            assert canned.requests[0].startswith(b"GET /b-1/k HTTP/1.1\r\nHost: x\r\n")

    run(scenario())


BAD_ANSWERS = {
    # A length that covers the chunked framing: read by length, the framing would be data.
    "chunked with a length": b"HTTP/1.1 200 OK\r\nContent-Length: 1012\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n"
    + OK_BODY + b"\r\n0\r\n\r\n",
    "no length": b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n" + OK_BODY,
    # Identical, allowed by RFC 9110 8.6 but refused by llhttp (and so by aiohttp): typed.
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\ncontent-length: 1000\r\n\r\n" + OK_BODY,
    "two different lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\ncontent-length: 999\r\n\r\n" + OK_BODY,
    "superscript length": b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n" + OK_BODY,
    "an upgrade": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
    "garbled status": b"HTTP/1.1 2OO OK\r\nContent-Length: 1000\r\n\r\n" + OK_BODY,
    "not http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad header line": b"HTTP/1.1 200 OK\r\nContent-Length 1000\r\n\r\n" + OK_BODY,
    "endless head": b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"a" * 70_000 + b"\r\n\r\n",
    "length too long": b"HTTP/1.1 200 OK\r\nContent-Length: 1001\r\n\r\n" + OK_BODY + b"x",
}


@pytest.mark.parametrize("name", sorted(BAD_ANSWERS))
def test_malformed_answers_fail_typed_and_close_the_connection(name: str) -> None:
    async def scenario() -> None:
        async with serving([BAD_ANSWERS[name], OK]) as (canned, pool):
            with pytest.raises(StoreUnavailable):
                await fetch(pool, 1012 if name == "chunked with a length" else 1000)
            assert pool.in_use == 0 and pool.idle == 0
            assert await fetch(pool) == OK_BODY  # on a new connection
            assert pool.opened == 2

    run(scenario())


def test_bytes_after_the_body_poison_no_later_answer() -> None:
    """A server that sends more than its Content-Length: the extra bytes must not be
    read as the next answer's head (or body) on a kept connection."""
    async def extra(writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)  # after the client has its body
        writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n\r\n" + b"E" * 1000)

    async def scenario() -> None:
        async with serving([extra, OK]) as (canned, pool):
            assert await fetch(pool) == OK_BODY
            await asyncio.sleep(0.1)  # the stray bytes arrive on the idle connection
            assert await fetch(pool) == OK_BODY
            assert pool.opened == 2

    run(scenario())


def test_short_body_then_close_is_transient() -> None:
    async def short(writer: asyncio.StreamWriter) -> None:
        writer.write(OK[: len(OK) - 10])
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with serving([short, OK]) as (canned, pool):
            with pytest.raises(StoreUnavailable, match="closed"):
                await fetch(pool)
            assert pool.in_use == 0
            assert await fetch(pool) == OK_BODY

    run(scenario())


def test_a_server_quiet_mid_body_times_out() -> None:
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(OK[: len(OK) - 10])
        await asyncio.sleep(3.0)

    async def scenario() -> None:
        async with serving([stall], read_timeout_s=0.3) as (canned, pool):
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(StoreTimeout):
                await fetch(pool)
            assert loop.time() - started < 2.5  # 0.3 s, wide margin: the property is "bounded"
            assert pool.in_use == 0 and pool.idle == 0

    run(scenario())


def test_an_idle_connection_the_server_closed_is_not_used() -> None:
    async def scenario() -> None:
        async with serving([OK]) as (canned, pool):
            assert await fetch(pool) == OK_BODY
            canned.writers[0].transport.abort()  # the server's idle timeout
            await asyncio.sleep(0.05)
            assert await fetch(pool) == OK_BODY
            assert (canned.connections, pool.opened) == (2, 2)

    run(scenario())


def test_waiting_for_a_connection_is_bounded() -> None:
    async def scenario() -> None:
        async with serving([OK], limit=1, connect_timeout_s=0.1, read_timeout_s=0.2) as (canned, pool):
            async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k"):  # holds the only one
                with pytest.raises(StoreUnreachable, match="waiting for a pooled connection"):
                    await fetch(pool)
            assert await fetch(pool) == OK_BODY

    run(scenario())


def test_an_unread_body_is_not_kept() -> None:
    """The caller left without reading (e.g. its allocator failed): the body's bytes
    are still coming, so the connection cannot serve the next GET."""
    async def scenario() -> None:
        async with serving([OK]) as (canned, pool):
            async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as answer:
                assert answer.status == 206
            assert pool.idle == 0 and pool.in_use == 0
            assert await fetch(pool) == OK_BODY

    run(scenario())


ERROR_XML = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>gone</Message></Error>"
ERROR_ANSWERS = {
    "length": b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(ERROR_XML), ERROR_XML),
    # AWS sends some error answers chunked: a GET path that demanded a Content-Length
    # would turn every such 404 into a transient failure, retried.
    "chunked": b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    % (len(ERROR_XML), ERROR_XML),
    "until close": b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\n" + ERROR_XML,
}


@pytest.mark.parametrize("name", sorted(ERROR_ANSWERS))
def test_error_answers_are_read_however_framed(name: str) -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(ERROR_ANSWERS[name])
        if name == "until close":
            await writer.drain()
            writer.close()

    async def scenario() -> None:
        async with serving([answer, OK], read_timeout_s=2.0) as (canned, pool):
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as got:
                assert got.status == 404
                assert b"<Code>NoSuchKey</Code>" in await got.read_error_body(64 * 1024)
            assert loop.time() - started < 1.5  # ended by its framing, not by the read timeout
            framed = name != "until close"
            assert (pool.in_use, pool.idle) == (0, int(framed))  # a framed error body keeps its connection
            assert await fetch(pool) == OK_BODY
            assert pool.opened == (1 if framed else 2)

    run(scenario())


def test_a_stalled_error_body_gives_what_came() -> None:
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Length: 500\r\n\r\n<Error><Code>SlowDown</Code>")
        await asyncio.sleep(3.0)

    async def scenario() -> None:
        async with serving([stall], read_timeout_s=0.3) as (canned, pool):
            async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as got:
                assert got.status == 503
                assert await got.read_error_body(64 * 1024) == b"<Error><Code>SlowDown</Code>"
            assert pool.in_use == 0 and pool.idle == 0

    run(scenario())


LEGAL_ANSWERS = {
    "chunked": b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + OK_BODY + b"\r\n0\r\n\r\n",
    "chunked in pieces": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"64\r\n" + OK_BODY[i : i + 100] + b"\r\n" for i in range(0, 1000, 100)) + b"0\r\n\r\n",
    "interim 100 and 103": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK,
}


@pytest.mark.parametrize("name", sorted(LEGAL_ANSWERS))
def test_legal_answers_are_read_and_keep_their_connection(name: str) -> None:
    async def scenario() -> None:
        async with serving([LEGAL_ANSWERS[name]], read_timeout_s=2.0) as (canned, pool):
            loop = asyncio.get_running_loop()
            started = loop.time()
            for _ in range(3):
                assert await fetch(pool) == OK_BODY
            assert loop.time() - started < 1.5  # an interim answer is not waited on as the final one
            assert (canned.connections, pool.idle) == (1, 1)

    run(scenario())


def test_many_404s_use_one_connection() -> None:
    """A consumer polls a promised blob with GETs that meet 404 until it is stored:
    each 404 must not cost a connection (and a TIME_WAIT socket, and over https a
    handshake)."""
    async def scenario() -> None:
        async with serving([ERROR_ANSWERS["length"]] * 50 + [OK]) as (canned, pool):
            for _ in range(50):
                async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as got:
                    assert got.status == 404
                    await got.read_error_body(64 * 1024)
            assert await fetch(pool) == OK_BODY
            assert (canned.connections, pool.opened) == (1, 1)

    run(scenario())


def test_an_error_body_over_its_bound_closes_the_connection() -> None:
    big = b"HTTP/1.1 503 Slow Down\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100_000

    async def scenario() -> None:
        async with serving([big, OK]) as (canned, pool):
            async with pool.get("/b-1/k", {"Host": "x"}, "GET", "k") as got:
                assert len(await got.read_error_body(1000)) == 1000
            assert pool.idle == 0
            assert await fetch(pool) == OK_BODY
            assert pool.opened == 2

    run(scenario())
