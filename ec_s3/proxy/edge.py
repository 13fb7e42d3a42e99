"""The proxy's client side: how many connections clients hold, and reading a request body
within its size, its deadline and the byte budget.

Owns :class:`EdgeSite` (``max_connections``, ``header_timeout_s``, the JSON answers it
gives before a request), :func:`read_body` (``body_timeout_s``, a ``Content-Encoding``
refused) and :class:`BodyRefused`. It does not own the limits' values (:mod:`.config`),
the budget itself (:mod:`.limits`), what a request is answered (:mod:`.chat`) nor the
upstream side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from aiohttp import web

from ec_s3.proxy.limits import BODY_COST_FACTOR, ByteBudget, NoRoom
from ec_s3.proxy.upstreams import Warner

__all__ = ["BodyRefused", "EdgeSite", "body_deadline", "check_head", "read_body"]


class BodyRefused(Exception):
    """A body the proxy will not take: the answer's status, the metric's reason, the
    client's message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def body_deadline(timeout_s: float) -> float:
    """The loop time by which a body whose head just arrived must be read."""
    return asyncio.get_running_loop().time() + timeout_s


def check_head(request: web.Request, max_bytes: int) -> int | None:
    """What the head announces: the body's length (None: chunked). Raises
    :class:`BodyRefused` for an encoded body or one announced larger than ``max_bytes``."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BodyRefused(
            415, "encoded_body",
            f"request bodies with Content-Encoding {encoding[:32]!r} are not accepted; send the body uncompressed",
        )
    length = request.content_length
    if length is not None and length > max_bytes:
        raise BodyRefused(413, "too_large", f"request body is larger than {max_bytes} bytes")
    return length


@contextlib.asynccontextmanager
async def read_body(request: web.Request, budget: ByteBudget, *, max_bytes: int,
                    deadline: float) -> AsyncIterator[bytes]:
    """The request's body, its share of ``budget`` held until the block ends. Raises
    :class:`BodyRefused`: 415 or 413 (:func:`check_head`, or 413 once more bytes came than
    ``max_bytes``), 503 when the budget has no room before ``deadline``, 408 when the
    body is not in by then."""
    length = check_head(request, max_bytes)
    # A chunked body is charged for the largest, then for what it turned out to be.
    charge = BODY_COST_FACTOR * (max_bytes if length is None else length)
    try:
        async with budget.hold(charge, deadline) as reservation:
            raw = await _read(request, max_bytes, deadline)
            reservation.shrink(BODY_COST_FACTOR * len(raw))
            yield raw
    except NoRoom:
        raise BodyRefused(
            503, "busy", "the server is reading or processing its limit of request bytes; retry shortly"
        ) from None


async def _read(request: web.Request, max_bytes: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise BodyRefused(413, "too_large", f"request body is larger than {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused(408, "body_timeout", "the request body did not arrive in time") from None
    return b"".join(chunks)


# --------------------------------------------------------------------------- connections
_OVERLOADED_BODY = json.dumps({"error": {
    "message": "the server holds its limit of connections; retry shortly", "type": "ServiceUnavailable",
    "param": None, "code": 503}}).encode()
_OVERLOADED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_OVERLOADED_BODY)).encode() + b"\r\n\r\n" + _OVERLOADED_BODY
)


class EdgeSite(web.BaseSite):
    """aiohttp's TCP site, holding at most ``max_connections`` client connections: one
    more is answered 503 and closed before anything of it is read."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 handler_args: dict[str, Any], warner: Warner) -> None:
        # A burst the loop is too busy to accept waits in the kernel's queue: with aiohttp's
        # 128, the rest lost their SYNs and retried 1, 3, 7, 15 s later (a /health probe
        # among them timed out), never reaching the 503 below. The kernel caps it at somaxconn.
        super().__init__(runner, backlog=max_connections)
        self._host = host
        self._port = port
        # What the runner was given for its protocols: each connection's is built here.
        self._handler_args = handler_args
        self._warner = warner
        self.max_connections = max_connections
        self.open = 0
        self.refused = 0

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            if self.open >= self.max_connections:
                self.refused += 1
                return _Refuse()
            self.open += 1
            return _Counted(_JsonErrors(server, self._warner, loop=loop, **self._handler_args), self)

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted in its site until the connection ends."""

    def __init__(self, inner: asyncio.Protocol, site: EdgeSite) -> None:
        self._inner = inner
        self._site: EdgeSite | None = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        site, self._site = self._site, None
        if site is not None:
            site.open -= 1
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _JsonErrors(web.RequestHandler):
    """aiohttp's protocol for one connection, except that a request its parser refuses (a
    bad request line, a header too long) is answered in OpenAI's JSON shape and logged in
    one rate-limited line, not in plain text with a traceback each."""

    def __init__(self, manager: web.Server, warner: Warner, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._ec_s3_warner = warner

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for an answer
            raise ConnectionError("response is sent already, cannot send another one with the error")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        if status >= 500:  # a bug, not a client's input: aiohttp's log line, traceback included
            self.log_exception("Error handling request", exc_info=exc)
            text = "internal proxy error"
        else:
            text = (message or phrase).splitlines()[0][:200] if (message or phrase).strip() else phrase
            self._ec_s3_warner.warn(("client", f"refused_head_{status}"),
                                    "ec-s3 proxy: refused a request from %s: HTTP %d: %s", request.remote, status, text)
        kind = phrase.title().replace(" ", "")
        resp = web.json_response({"error": {"message": text, "type": kind, "param": None, "code": status}},
                                 status=status)
        resp.force_close()
        return resp


class _Refuse(asyncio.Protocol):
    """A connection beyond the cap: a 503 and the connection closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_OVERLOADED)
        transport.close()
