"""A fault-injecting HTTP/1.1 proxy between an S3 client and a real S3 server.

Reliability tests need the store to meet slow, failing, hanging and lying servers on
demand, per request, while a real server keeps the happy path honest. The proxy runs
its own asyncio loop in a daemon thread; every fault is set from the test thread
through locked methods and takes effect on the next request (a stall also on the
requests it is holding). It parses HTTP/1.1 framing (Content-Length, chunked, HEAD,
keep-alive, ``Expect: 100-continue``) so that it can act on one request at a time. The
``Host`` header is forwarded untouched: SigV4 signs it.

Order of checks per request: down, stall, latency, reset, error, then forward (where
the credentials rewrite acts on the request, and drop_response, then an answer rewrite,
truncate and corrupt, act on the upstream's answer). Setting a fault replaces its previous setting;
``clear()`` removes all, releasing stalled requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["FaultCounters", "FaultProxy"]

_READ_SIZE = 64 * 1024
_MAX_HEAD = 64 * 1024
_CORRUPT_WINDOW = 16
_STALL_POLL_S = 0.02
# The access key id inside a SigV4 ``Authorization`` header: ``Credential=<id>/<date>/...``.
_SIGV4_CREDENTIAL = re.compile(rb"(Credential=)([^/,\s]+)(/)")
_ERROR_CODES = {
    400: ("BadRequest", "Injected bad request."),
    403: ("AccessDenied", "Access Denied."),
    404: ("NoSuchKey", "The specified key does not exist."),
    409: ("OperationAborted", "A conflicting conditional operation is in progress."),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
    429: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    501: ("NotImplemented", "Injected not implemented."),
    502: ("BadGateway", "Injected bad gateway."),
    503: ("SlowDown", "Please reduce your request rate."),
    504: ("GatewayTimeout", "Injected gateway timeout."),
}
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    412: "Precondition Failed",
    429: "Too Many Requests",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass(frozen=True)
class FaultCounters:
    """Snapshot of what the proxy saw and did; ``held_now`` is a gauge, the rest count up."""

    connections: int = 0
    requests: int = 0
    forwarded: int = 0
    down_refused: int = 0
    stalled: int = 0
    stall_abandoned: int = 0
    latency: int = 0
    resets: int = 0
    errors: int = 0
    truncated: int = 0
    corrupted: int = 0
    dropped_responses: int = 0
    upstream_failures: int = 0
    auth_rewritten: int = 0
    rewritten: int = 0
    held_now: int = 0


@dataclass
class _Rule:
    methods: frozenset[str] | None = None
    remaining: int | None = None  # one-shot count; None = every matching request
    rate: float = 1.0
    status: int = 503
    seconds: float = 0.0
    access_key_id: str = ""
    target_contains: str = ""  # only requests whose target (path and query) holds this
    code: str = ""  # the S3 error code of an injected error ("" = the status's usual one)
    answer_status: int = 0  # rewrite: the upstream status this rule replaces
    answer: bytes = b""  # rewrite: the whole answer sent instead

    def matches(self, method: str, target: str = "") -> bool:
        return (self.methods is None or method in self.methods) and self.target_contains in target


@dataclass
class _Request:
    method: str
    target: str  # request target (path and query), for tests that check what was asked
    head: bytes  # as forwarded: Expect removed
    body: bytes
    close: bool


@dataclass
class _Link:
    """The upstream connection paired with one client connection (reused while alive)."""

    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def drop(self) -> None:
        if self.conn is not None:
            self.conn[1].transport.abort()
            self.conn = None


@dataclass
class _Response:
    status: int
    head: bytes
    headers: dict[str, str]


class _Close(Exception):
    """End this client connection (the writer has been closed or aborted already)."""


def _methods(methods: Iterable[str] | None) -> frozenset[str] | None:
    return None if methods is None else frozenset(m.upper() for m in methods)


def _parse_head(raw: bytes) -> tuple[list[bytes], dict[str, str], list[bytes]]:
    lines = raw[:-4].split(b"\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return lines[0].split(b" ", 2), headers, lines[1:]


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0 so the peer gets a TCP RST rather than a clean FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """Read one chunked body and return it raw (framing included), for forwarding."""
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        out += line
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                out += trailer
            out += b"\r\n"
            return bytes(out)
        out += await reader.readexactly(size + 2)


class FaultProxy:
    """Loopback HTTP/1.1 proxy to ``upstream_url`` with faults switchable at runtime."""

    def __init__(self, upstream_url: str, *, seed: int | None = None) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"need http://host:port, got {upstream_url!r}")
        self._upstream = (parts.hostname, parts.port)
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: dict[str, _Rule] = {}
        self._delays: list[tuple[frozenset[str] | None, float]] = []  # delay_next's, in turn
        self._down = False
        self._counts = dict.fromkeys((f.name for f in fields(FaultCounters)), 0)
        self._request_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._port = 0
        self.seen: list[tuple[str, str]] = []  # (method, target) of every request

    def set_upstream(self, upstream_url: str) -> None:
        """Point new connections at another server (e.g. one restarted on new ports)."""
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"need http://host:port, got {upstream_url!r}")
        with self._lock:
            self._upstream = (parts.hostname, parts.port)

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", 0, limit=_MAX_HEAD)
                )
                self._port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # reported to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            self._thread = None
            raise RuntimeError(f"fault proxy did not start: {failure!r}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection (held ones included); idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        self._thread = None

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout_s)

        with contextlib.suppress(Exception):  # best effort: the loop is stopped anyway
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout_s + 1)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        if not self._port:
            raise RuntimeError("proxy not started")
        return f"http://127.0.0.1:{self._port}"

    # -- faults (thread-safe) -----------------------------------------------------------

    def set_latency(self, seconds: float, methods: Iterable[str] | None = None, *,
                    target_contains: str = "") -> None:
        """Delay every matching request by ``seconds`` before forwarding (0 clears); only
        requests whose target holds ``target_contains`` (e.g. one object's key), if given."""
        rule = _Rule(_methods(methods), seconds=seconds, target_contains=target_contains) if seconds > 0 else None
        self._set("latency", rule)

    def delay_next(self, seconds: Iterable[float], methods: Iterable[str] | None = None) -> None:
        """Delay the next matching requests before forwarding, one each, by ``seconds`` in
        turn (e.g. a slow first request, then a slower second one)."""
        with self._lock:
            self._delays = [(_methods(methods), s) for s in seconds]

    def set_stall(self, enabled: bool, methods: Iterable[str] | None = None) -> None:
        """Hold matching requests unanswered; clearing it forwards the held ones."""
        self._set("stall", _Rule(_methods(methods)) if enabled else None)

    def set_error_rate(
        self, rate: float, status: int = 503, methods: Iterable[str] | None = None
    ) -> None:
        """Answer this fraction of matching requests with an S3 error, unforwarded."""
        rule = _Rule(_methods(methods), rate=rate, status=status) if rate > 0 else None
        self._set("error_rate", rule)

    def error_next(self, n: int, status: int = 503, methods: Iterable[str] | None = None, *,
                   target_contains: str = "", code: str = "") -> None:
        """Answer exactly the next ``n`` matching requests with an S3 error (of ``code``
        when given, e.g. NoSuchUpload; only requests whose target holds
        ``target_contains``, e.g. ``uploadId=`` for a multipart Complete or Abort)."""
        self._set("error_next", _Rule(_methods(methods), remaining=n, status=status,
                                      target_contains=target_contains, code=code))

    def rewrite_answer_next(self, n: int, status: int, answer: bytes, methods: Iterable[str] | None = None, *,
                            target_contains: str = "") -> None:
        """Forward the next ``n`` matching requests; where the server answers ``status``,
        send ``answer`` (a whole HTTP response) instead: a server that ignores a
        condition (a 412 becomes a 200) as the client sees it, with SigV4 intact."""
        self._set("rewrite", _Rule(_methods(methods), remaining=n, answer_status=status, answer=answer,
                                   target_contains=target_contains))

    def set_reset_rate(self, rate: float, methods: Iterable[str] | None = None) -> None:
        """Reset (TCP RST) the connection instead of answering this fraction of requests."""
        self._set("reset_rate", _Rule(_methods(methods), rate=rate) if rate > 0 else None)

    def reset_next(self, n: int, methods: Iterable[str] | None = None) -> None:
        self._set("reset_next", _Rule(_methods(methods), remaining=n))

    def truncate_next(self, n: int, methods: Iterable[str] | None = None) -> None:
        """Forward, then close after half of the next ``n`` non-empty response bodies."""
        self._set("truncate", _Rule(_methods(methods), remaining=n))

    def corrupt_next(self, n: int, methods: Iterable[str] | None = None, target_contains: str = "") -> None:
        """Forward, flipping a few bytes mid-body (same length) in the next ``n`` bodies
        (of requests whose target holds ``target_contains``: one object's key)."""
        self._set("corrupt", _Rule(_methods(methods), remaining=n, target_contains=target_contains))

    def drop_response_next(self, n: int, methods: Iterable[str] | None = None, *, target_contains: str = "") -> None:
        """Forward the next ``n`` requests, then reset instead of relaying the answer.

        The server has acted (a PUT landed) but the client never learns it: the case
        where a retried conditional PUT meets its own first attempt.
        """
        self._set("drop_response", _Rule(_methods(methods), remaining=n, target_contains=target_contains))

    def set_wrong_credentials(self, access_key_id: str | None, methods: Iterable[str] | None = None) -> None:
        """Rewrite the access key id of matching requests' SigV4 ``Authorization`` header
        to ``access_key_id`` before forwarding, so the real server itself answers
        403 InvalidAccessKeyId (credentials revoked or rotated under a running
        client). None clears."""
        rule = _Rule(_methods(methods), access_key_id=access_key_id) if access_key_id else None
        self._set("credentials", rule)

    def set_down(self, enabled: bool) -> None:
        """Reset every new connection, and kept-alive ones at their next request."""
        with self._lock:
            self._down = enabled

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._delays.clear()
            self._down = False

    @property
    def counters(self) -> FaultCounters:
        with self._lock:
            return FaultCounters(**self._counts)

    def wait_until(
        self, predicate: Callable[[FaultCounters], bool], timeout_s: float = 5.0
    ) -> FaultCounters:
        """Poll the counters until ``predicate`` holds (e.g. a request is held)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(snapshot := self.counters):
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy condition not met in {timeout_s} s: {snapshot}")
            time.sleep(0.01)
        return snapshot

    # -- fault decisions (called from the loop thread) ------------------------------------

    def _set(self, kind: str, rule: _Rule | None) -> None:
        with self._lock:
            if rule is None:
                self._rules.pop(kind, None)
            else:
                self._rules[kind] = rule

    def _count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self._counts[name] += delta

    def _is_down(self) -> bool:
        with self._lock:
            return self._down

    def _peek(self, kind: str, method: str, target: str = "") -> _Rule | None:
        with self._lock:
            rule = self._rules.get(kind)
            return rule if rule is not None and rule.matches(method, target) else None

    def _take(self, kind: str, method: str, target: str = "") -> _Rule | None:
        """Return the rule if it fires for this request, spending one of its one-shot count."""
        with self._lock:
            rule = self._rules.get(kind)
            if rule is None or not rule.matches(method, target):
                return None
            if rule.remaining is not None:
                if rule.remaining <= 0:
                    return None
                rule.remaining -= 1
                return rule
            return rule if rule.rate >= 1.0 or self._random.random() < rule.rate else None

    # -- connection handling ----------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        link = _Link()
        self._count("connections")
        try:
            while True:
                if self._is_down():
                    self._count("down_refused")
                    _abort(writer)
                    return
                request = await self._read_request(reader, writer)
                if request is None:
                    return
                self._count("requests")
                with self._lock:
                    self.seen.append((request.method, request.target))
                if self._is_down():
                    self._count("down_refused")
                    _abort(writer)
                    return
                if not await self._apply_delays(request.method, request.target, reader):
                    writer.close()
                    return
                if self._take("reset_next", request.method) or self._take(
                    "reset_rate", request.method
                ):
                    self._count("resets")
                    _abort(writer)
                    return
                rule = self._take("error_next", request.method, request.target) or self._take(
                    "error_rate", request.method
                )
                if rule is not None:
                    self._count("errors")
                    writer.write(self._error_response(rule.status, request.method, rule.code))
                    await writer.drain()
                else:
                    if not await self._forward(request, link, writer):
                        writer.close()
                        return
                if request.close:
                    writer.close()
                    return
        except _Close:
            pass
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            _abort(writer)
        finally:
            link.drop()
            if not writer.transport.is_closing():
                writer.transport.abort()  # cancelled by stop(), or an unexpected error
            self._tasks.discard(task)

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Request | None:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise
            return None  # clean close between requests
        (method_b, *_rest), headers, lines = _parse_head(raw)
        method = method_b.decode("latin-1").upper()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = int(headers.get("content-length", "0") or "0")
        if headers.get("expect", "").lower() == "100-continue":
            # aiohttp waits for this with no timeout; upstream never sees the Expect.
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if chunked:
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(length) if length else b""
        kept = [raw.split(b"\r\n", 1)[0]]
        kept += [line for line in lines if not line.lower().startswith(b"expect:")]
        head = b"\r\n".join(kept) + b"\r\n\r\n"
        close = headers.get("connection", "").lower() == "close"
        target = head.split(b" ", 2)[1].decode("latin-1") if head.count(b" ") >= 2 else ""
        return _Request(method=method, target=target, head=head, body=body, close=close)

    async def _apply_delays(self, method: str, target: str, reader: asyncio.StreamReader) -> bool:
        """Stall, then add latency. False when the client left while held."""
        if self._peek("stall", method) is not None:
            with self._lock:
                self._counts["stalled"] += 1
                self._counts["held_now"] += 1
            try:
                while self._peek("stall", method) is not None:
                    if reader.at_eof():  # request fully read, so EOF means gone
                        self._count("stall_abandoned")
                        return False
                    await asyncio.sleep(_STALL_POLL_S)
            finally:
                self._count("held_now", -1)
        with self._lock:
            once = self._delays.pop(0)[1] if self._delays and method in (self._delays[0][0] or {method}) else 0.0
        if once:
            self._count("latency")
            await asyncio.sleep(once)
        rule = self._peek("latency", method, target)
        if rule is not None:
            self._count("latency")
            await asyncio.sleep(rule.seconds)
        return True

    def _error_response(self, status: int, method: str, code: str = "") -> bytes:
        usual, message = _ERROR_CODES.get(status, ("InjectedFault", "Injected fault."))
        code = code or usual
        request_id = f"FAULTPROXY{next(self._request_ids):08d}"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{request_id}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {0 if method == 'HEAD' else len(body)}\r\n"
            f"x-amz-request-id: {request_id}\r\n"
            "Server: faultproxy\r\n\r\n"
        ).encode()
        return head if method == "HEAD" else head + body

    async def _forward(self, request: _Request, link: _Link, writer: asyncio.StreamWriter) -> bool:
        """Relay one exchange over ``link``; False when the client connection must end."""
        response: _Response | None = None
        wrong = self._peek("credentials", request.method)
        if wrong is not None:
            head, n = _SIGV4_CREDENTIAL.subn(
                lambda m: m.group(1) + wrong.access_key_id.encode("latin-1") + m.group(3), request.head, count=1
            )
            if n:
                self._count("auth_rewritten")
                request = _Request(request.method, request.target, head, request.body, request.close)
        for attempt in range(2):
            reused = link.conn is not None
            if link.conn is None:
                try:
                    link.conn = await asyncio.open_connection(*self._upstream, limit=_MAX_HEAD)
                except OSError:
                    self._count("upstream_failures")
                    _abort(writer)
                    raise _Close from None
            ureader, uwriter = link.conn
            try:
                uwriter.write(request.head + request.body)
                await uwriter.drain()
                response = await self._read_response_head(ureader, writer)
            except (OSError, asyncio.IncompleteReadError):
                response = None
            if response is not None:
                break
            link.drop()
            if not (reused and attempt == 0):  # only a stale keep-alive earns a retry
                self._count("upstream_failures")
                _abort(writer)
                raise _Close
        assert response is not None and link.conn is not None
        self._count("forwarded")
        ureader = link.conn[0]
        if self._take("drop_response", request.method, request.target) is not None:
            self._count("dropped_responses")
            _abort(writer)
            raise _Close  # the caller drops the upstream link, its answer unread

        h = response.headers
        no_body = request.method == "HEAD" or response.status in (204, 304)
        chunked = not no_body and "chunked" in h.get("transfer-encoding", "").lower()
        length = (
            None if no_body or chunked or "content-length" not in h else int(h["content-length"])
        )
        until_close = not no_body and not chunked and length is None
        if not until_close and await self._rewrite(request, response.status, ureader, writer, chunked, length):
            return True
        has_body = chunked or until_close or bool(length)
        truncate = has_body and self._take("truncate", request.method) is not None
        corrupt = has_body and self._take("corrupt", request.method, request.target) is not None
        self._count("truncated", int(truncate))
        self._count("corrupted", int(corrupt))

        writer.write(response.head)
        if chunked:
            await self._relay_chunked(ureader, writer, truncate, corrupt)
        elif has_body:
            await self._relay_length(ureader, writer, length, truncate, corrupt)
        await writer.drain()
        if until_close or h.get("connection", "").lower() == "close":
            link.drop()
        return not until_close

    async def _rewrite(self, request: _Request, status: int, ureader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, chunked: bool, length: int | None) -> bool:
        """Send a rewrite rule's answer in place of the upstream's (read and dropped)."""
        with self._lock:
            rule = self._rules.get("rewrite")
            if rule is None or not rule.matches(request.method, request.target) or rule.answer_status != status:
                return False
            if rule.remaining is not None:
                if rule.remaining <= 0:
                    return False
                rule.remaining -= 1
        if chunked:
            await _read_chunked(ureader)
        elif length:
            await ureader.readexactly(length)
        self._count("rewritten")
        writer.write(rule.answer)
        await writer.drain()
        return True

    async def _read_response_head(
        self, ureader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Response | None:
        """Read the final response head, passing 1xx interim responses through."""
        while True:
            try:
                raw = await ureader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                return None
            (_version, status_b, *_reason), headers, _ = _parse_head(raw)
            status = int(status_b)
            if 100 <= status < 200 and status != 101:
                writer.write(raw)
                continue
            return _Response(status=status, head=raw, headers=headers)

    @staticmethod
    def _mangle(data: bytes, offset: int, total: int, corrupt: bool) -> bytes:
        """Flip a small window of bytes around the middle of a ``total``-byte body."""
        if not corrupt or not data:
            return data
        mid = total // 2
        lo = max(offset, mid - _CORRUPT_WINDOW // 2)
        hi = min(offset + len(data), lo + _CORRUPT_WINDOW)
        if lo >= hi:
            return data
        out = bytearray(data)
        for i in range(lo - offset, hi - offset):
            out[i] ^= 0xFF
        return bytes(out)

    async def _relay_length(
        self,
        ureader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        length: int | None,
        truncate: bool,
        corrupt: bool,
    ) -> None:
        """Relay a Content-Length body, or one delimited by close when ``length`` is None."""
        cut = None if not truncate else (length // 2 if length is not None else 0)
        offset = 0
        while length is None or offset < length:
            want = _READ_SIZE if length is None else min(_READ_SIZE, length - offset)
            data = await ureader.read(want)
            if not data:
                if length is None:
                    return
                _abort(writer)  # upstream died mid-body: the client must notice
                raise _Close
            total = length if length is not None else offset + len(data)
            data = self._mangle(data, offset, total, corrupt)
            corrupt = corrupt and length is not None  # unknown length: first read only
            if cut is not None and offset + len(data) >= cut:
                writer.write(data[: max(cut - offset, len(data) // 2 if length is None else 0)])
                await writer.drain()
                writer.close()  # clean FIN after a short body
                raise _Close
            writer.write(data)
            await writer.drain()
            offset += len(data)

    async def _relay_chunked(
        self,
        ureader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        truncate: bool,
        corrupt: bool,
    ) -> None:
        """Relay a chunked body as-is; faults hit the first non-empty chunk."""
        while True:
            line = await ureader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            writer.write(line)
            if size == 0:
                while (trailer := await ureader.readuntil(b"\r\n")) != b"\r\n":
                    writer.write(trailer)
                writer.write(b"\r\n")
                return
            data = await ureader.readexactly(size)
            ending = await ureader.readexactly(2)
            if truncate:
                writer.write(data[: size // 2])
                await writer.drain()
                writer.close()
                raise _Close
            if corrupt:
                corrupt, data = False, self._mangle(data, 0, size, True)
            writer.write(data + ending)
            await writer.drain()
