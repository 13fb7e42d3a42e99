"""GET bodies read by the kernel (or, over TLS, the decryption) straight into the caller's buffer.

Owns a small keep-alive pool of HTTP/1.1 connections to one endpoint (at most ``limit``, idle
ones closed), the connect and per-read timeouts, and reading each answer: its head through
:mod:`.http1`, a body of known length by ``recv_into`` into the caller's buffer; a connection
is reused only after a whole answer read to its framed end. Does not own the SSL context,
proxies, the URL, signing and headers (:mod:`.wire`), which answers are which typed errors
(:func:`.error_map.from_status`), retries and the CRC (:mod:`.client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from ec_s3.store.error_map import tls_error
from ec_s3.store.errors import StoreError, StoreTimeout, StoreUnavailable, StoreUnreachable
from ec_s3.store.http1 import Answer, HTTPProtocolError

__all__ = ["RecvAnswer", "RecvPool"]

# A response head longer than this is not S3's (interim answers included).
MAX_HEAD_BYTES = 64 * 1024
_HEAD_READ = 4096
# A body the parser reads (chunked, an error answer's) comes through a buffer this big.
_FRAMED_READ = 64 * 1024


class _Fault(Exception):
    """A broken exchange, typed by the pool once it knows the op and key."""

    def __init__(self, message: str, *, timeout: bool = False, stale: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.stale = stale  # nothing of an answer came back: safe to resend


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive connection. States: ``idle`` (between exchanges: any byte is a
    protocol error), ``head`` (the answer's bytes go to the parser until its final head
    is in), ``paused`` (head in, socket reading paused until the caller says where the
    body goes), ``body`` (the kernel writes into the caller's buffer; the parser never
    sees these bytes), ``framed`` (the parser reads the body, chunked or an error
    answer's, and hands it to a sink), ``closed`` (aborted or lost: nothing is written
    into a caller's buffer any more)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self._loop = loop
        self._read_timeout = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self.exchanges = 0
        self.last_used = loop.time()
        self._state = "idle"
        self._scratch = bytearray(_FRAMED_READ)
        self._answer = Answer()
        self._hlen = 0
        self._out: memoryview | None = None
        self._pos = 0
        self._waiter: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0

    # -- asyncio.BufferedProtocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == "body" and self._out is not None:
            return self._out[self._pos :]
        if self._state == "head":
            # A few KiB at a time: a head is ~0.5 KiB, and the body bytes read along
            # with it are the only ones copied (into ``early``), so keep them few.
            return memoryview(self._scratch)[:_HEAD_READ]
        return memoryview(self._scratch)  # framed, or idle: whatever comes is an error

    def buffer_updated(self, nbytes: int) -> None:
        self._last_read = self._loop.time()
        if self._state == "body":
            self._pos += nbytes
            if self._out is not None and self._pos >= len(self._out):
                self._state = "idle"
                self._finish(None)
        elif self._state in ("head", "framed"):
            self._parse(nbytes)
        elif self._state != "closed":
            self._fail(_Fault("bytes arrived outside of an answer"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        stale = self._state == "head" and self._hlen == 0 and self.exchanges > 0
        reason = f"{type(exc).__name__}: {exc}" if exc else "closed by the server"
        where = "before answering" if self._state == "head" else f"after {self._pos} body bytes"
        self._state = "closed"
        self._fail(_Fault(f"connection {reason} {where}", stale=stale), close=False)

    # -- driven by the pool --------------------------------------------------------------
    async def exchange(self, request: bytes) -> Answer:
        """Send ``request`` and wait for the answer's final head (interim 1xx skipped)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _Fault("connection closed while idle", stale=self.exchanges > 0)
        self.reusable = False
        self._answer = Answer()
        self._state, self._hlen, self._pos, self._out = "head", 0, 0, None
        self._waiter = self._loop.create_future()
        self.transport.write(request)
        self._arm()
        return await self._waiter  # type: ignore[no-any-return]

    async def read_body(self, out: memoryview) -> None:
        """Fill ``out`` (the whole rest of a body of known length): first the bytes
        that came with the head, then the kernel writes the rest in place."""
        if self.closed or self.transport is None:
            raise _Fault("connection closed before the body")
        early = self._answer.early
        n = min(len(early), len(out))
        out[:n] = early[:n]
        if n >= len(out):
            self._state = "idle"
            self.transport.resume_reading()  # idle: notice the server closing it
            return
        self._out, self._pos, self._state = out, n, "body"
        await self._wait_reading()

    async def read_framed(self, sink: Callable[[bytes], bool]) -> bool:
        """Hand the body, as the parser reads it, to ``sink`` until its end; True when
        it ended by its framing. ``sink`` returns False to stop early (the connection
        is then aborted). A close or a quiet server raises :class:`_Fault`."""
        answer = self._answer
        if answer.early and not sink(bytes(answer.early)):
            self.abort()
            return False
        answer.early.clear()
        if answer.complete or answer.framing == "none":
            self._state = "idle"
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()  # idle: notice the server closing it
            return True
        if self.closed or self.transport is None:
            raise _Fault("connection closed before the body")

        def feed(data: bytes) -> None:
            if not sink(data):
                self._fail(_Fault("body over its bound"))

        answer.sink = feed
        self._state = "framed"
        await self._wait_reading()
        return True

    def abort(self) -> None:
        self.reusable = False
        self.closed = True
        self._state = "closed"  # TLS may still hand over decrypted bytes: into the scratch
        self._disarm()
        self._out = None  # never again written into: the caller may reuse its buffer now
        if self.transport is not None:
            self.transport.abort()  # stops reading at once, before returning

    # -- internals -----------------------------------------------------------------------
    async def _wait_reading(self) -> None:
        assert self.transport is not None
        self._waiter = self._loop.create_future()
        self.transport.resume_reading()
        self._arm()
        await self._waiter

    def _parse(self, nbytes: int) -> None:
        head = self._state == "head"
        self._hlen += nbytes
        try:
            self._answer.feed(memoryview(self._scratch)[:nbytes])
        except HTTPProtocolError as exc:
            self._fail(_Fault(f"malformed answer: {exc}"))
            return
        if self._state == "closed":
            return  # a sink stopped it
        if head and self._answer.head_done:
            self.reusable = self._answer.keep_alive
            self._state = "paused"
            self._disarm()  # the caller, not the server, is what we wait for now
            assert self.transport is not None
            self.transport.pause_reading()
            self._finish(self._answer)
        elif head and self._hlen >= MAX_HEAD_BYTES:
            self._fail(_Fault(f"answer head over {MAX_HEAD_BYTES} bytes"))
        elif not head and self._answer.complete:
            self._state = "idle"
            self._finish(None)

    def _arm(self) -> None:
        self._last_read = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._check_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        # One timer per read_timeout, not one per received chunk: each chunk only
        # stamps _last_read, and the timer re-arms itself for the remaining time.
        self._timer = None
        if self._state not in ("head", "body", "framed"):
            return
        due = self._last_read + self._read_timeout
        if self._loop.time() >= due:
            self._fail(_Fault(f"no bytes from the server for {self._read_timeout:g}s", timeout=True))
        else:
            self._timer = self._loop.call_at(due, self._check_timeout)

    def _finish(self, result: Any) -> None:
        self._disarm()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(result)

    def _fail(self, fault: _Fault, *, close: bool = True) -> None:
        waiter, self._waiter = self._waiter, None
        if close:
            self.abort()
        else:
            self._disarm()
            self._out = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(fault)


class RecvAnswer:
    """A response's final head; :meth:`read_into` reads its body into the caller's buffer."""

    def __init__(self, conn: _Conn, op: str, key: str, parsed: Answer) -> None:
        self._conn, self._op, self._key = conn, op, key
        self.status, self.reason, self.headers = parsed.status, parsed.reason, parsed.headers
        self.framing = parsed.framing
        self.content_length = parsed.content_length
        self.complete = False
        if self.status in (200, 206) and self.framing not in ("length", "chunked"):
            # Read to the close, a cut body would look whole: refuse it.
            raise StoreUnavailable(op, key, "answer has neither a Content-Length nor chunked framing")

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` with the whole body of a 200/206: ``len(out)`` must be its
        length. A body of known length is written in place by the kernel; a chunked
        one comes through the parser (copied)."""
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        if self.status not in (200, 206) or (self.framing == "length" and len(out) != self.content_length):
            raise StoreUnavailable(self._op, self._key, f"body is {self.content_length} bytes, buffer {len(out)}")
        pos = 0

        def into(data: bytes) -> bool:
            nonlocal pos
            end = pos + len(data)
            if end > len(out):
                return False
            out[pos:end] = data
            pos = end
            return True

        try:
            if self.framing == "length":
                await self._conn.read_body(out)
            elif not await self._conn.read_framed(into):
                raise _Fault("body longer than expected")
        except _Fault as fault:
            raise _typed(self._op, self._key, fault) from None
        if pos != len(out) and self.framing == "chunked":
            raise StoreUnavailable(self._op, self._key, f"chunked body of {pos} bytes, expected {len(out)}")
        self.complete = True

    async def read_to_end(self, limit: int) -> bytes:
        """The whole body of a 200 of unknown length (chunked), at most ``limit`` bytes."""
        if self.content_length is not None:
            if self.content_length > limit:
                raise StoreUnavailable(self._op, self._key, f"body of {self.content_length} bytes over {limit}")
            out = bytearray(self.content_length)
            await self.read_into(memoryview(out))
            return bytes(out)
        body = bytearray()

        def collect(data: bytes) -> bool:
            body.extend(data)
            return len(body) <= limit

        try:
            if not await self._conn.read_framed(collect):
                raise _Fault(f"body over {limit} bytes")
        except _Fault as fault:
            raise _typed(self._op, self._key, fault) from None
        self.complete = True
        return bytes(body)

    async def read_error_body(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of an error answer's body, as its framing says; what
        came before a close or a timeout. The connection is kept only when the body
        was framed (a length, chunked or none) and read to its end within ``limit``:
        a consumer polling a promised blob meets a 404 per GET."""
        body = bytearray()

        def keep(data: bytes) -> bool:
            body.extend(data[: limit - len(body)])
            return len(body) < limit

        with contextlib.suppress(_Fault):
            ended = await self._conn.read_framed(keep)
            self.complete = ended and self.framing != "close"
        return bytes(body)


def _typed(op: str, key: str, fault: _Fault) -> StoreError:
    cls = StoreTimeout if fault.timeout else StoreUnavailable
    return cls(op, key, str(fault))


class RecvPool:
    """Keep-alive connections to one endpoint, at most ``limit`` open.

    Built and used on one event loop; :meth:`close` aborts every connection.
    """

    def __init__(
        self, endpoint_url: str, *, limit: int, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or (parts.scheme == "https") != bool(ssl_context):
            raise ValueError(f"RecvPool needs http://, or https:// with an SSL context, not {parts.scheme!r}")
        self._host, self._port = parts.hostname, parts.port or (443 if ssl_context else 80)
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._keepalive = keepalive_s
        self._permits = asyncio.Semaphore(limit)
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self.opened = 0  # connections made so far (tests: keep-alive reuse)

    @property
    def in_use(self) -> int:
        return len(self._busy)

    @property
    def idle(self) -> int:
        return sum(1 for c in self._idle if not c.closed)

    async def close(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.abort()
        self._idle.clear()
        self._busy.clear()

    @contextlib.asynccontextmanager
    async def get(self, target: str, headers: dict[str, str], op: str, key: str) -> AsyncIterator[RecvAnswer]:
        """Send ``GET target`` with ``headers`` (signed, ``Host`` included) and yield the
        answer, any status; its connection goes back to the pool only if the caller read
        the whole body and left without an exception."""
        request = "".join([f"GET {target} HTTP/1.1\r\n", *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"])
        try:
            # The store bounds concurrency below this pool's size, so a wait here means
            # held-up connections: bounded as aiohttp's pool wait is (connect + read).
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
            # that races the acquisition, and the cancelled GET then writes on into a
            # buffer its caller has already given up (tests/store/test_store_faults.py).
            async with asyncio.timeout(self._connect_timeout + self._read_timeout):
                await self._permits.acquire()
        except TimeoutError:
            raise StoreUnreachable(op, key, "timed out waiting for a pooled connection") from None
        conn: _Conn | None = None
        answer: RecvAnswer | None = None
        try:
            conn, answer = await self._exchange(request.encode("latin-1"), op, key)
            yield answer
        finally:
            if conn is not None:
                self._busy.discard(conn)
                # Kept only after a whole answer, read to its framed end (an error
                # answer's too, even when the caller then raises its typed error):
                # any unread byte would poison the next answer.
                if answer is not None and answer.complete and conn.reusable and not conn.closed:
                    conn.last_used = asyncio.get_running_loop().time()
                    self._idle.append(conn)
                else:
                    conn.abort()
            self._permits.release()

    async def _exchange(self, request: bytes, op: str, key: str) -> tuple[_Conn, RecvAnswer]:
        for attempt in (1, 2):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(op, key)
            self._busy.add(conn)
            try:
                parsed = await conn.exchange(request)
                conn.exchanges += 1
                return conn, RecvAnswer(conn, op, key, parsed)
            except _Fault as fault:
                conn.abort()
                self._busy.discard(conn)
                if fault.stale and reused and attempt == 1:
                    continue  # the server closed an idle keep-alive: resend on a fresh one
                raise _typed(op, key, fault) from None
            except BaseException:
                conn.abort()
                self._busy.discard(conn)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _take_idle(self) -> _Conn | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.last_used < self._keepalive:
                return conn
            conn.abort()
        return None

    async def _connect(self, op: str, key: str) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self._read_timeout), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            raise StoreUnreachable(op, key, f"connect timed out after {self._connect_timeout:g}s") from None
        except ssl.SSLError as exc:  # an OSError too: first
            raise tls_error(op, key, exc, f"TLS handshake failed: {type(exc).__name__}: {exc}",
                            host=self._host, port=self._port) from exc
        except OSError as exc:
            raise StoreUnreachable(op, key, f"cannot connect: {type(exc).__name__}: {exc}") from exc
        self.opened += 1
        return conn
