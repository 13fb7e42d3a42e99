"""An HTTP/1.1 answer read by llhttp (httptools): its head, framing and whether its connection may be kept.

Why a parser and not code of our own: the status line, header syntax, number syntax,
interim ``1xx`` answers, ``Transfer-Encoding`` and chunk framing are where hand-written
HTTP goes wrong (``str.isdigit`` accepts ``²``, a ``100 Continue`` taken as the answer,
a chunked 200 refused). llhttp is Node.js's parser, tested against the RFC, and the one
aiohttp (the botocore path) uses, so both data paths judge an answer alike; its C code
reads a head in less time than ec-s3's own Python did, h11 (pure Python) in far more.
One consequence of llhttp's strictness: a repeated ``Content-Length``, even with the
same value, is refused (RFC 9110 8.6 lets a recipient reject it; aiohttp refuses it
too), a typed error on both paths.

Owns: :class:`Answer`, fed the bytes of one exchange as they arrive (sans-I/O): it skips
interim ``1xx`` answers, knows the final head (status, headers, keep-alive), how its
body is framed (:attr:`Answer.framing`), and, for bodies the parser reads itself
(chunked, error answers), hands their bytes to a sink and says when the body ended.
Does not own sockets, timeouts and the zero-copy path for a body of known length
(:mod:`.recv`: those bytes never pass through the parser), nor what an answer means
(:mod:`.errors`, :mod:`.ranges`).
"""

from __future__ import annotations

from collections.abc import Callable

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["Answer", "HTTPProtocolError"]


class HTTPProtocolError(Exception):
    """The bytes are not a well-formed HTTP/1.1 answer (or more came than one answer)."""


class Answer:
    """One request's answer, parsed as its bytes are fed. After :meth:`feed` reports the
    head, ``status``, ``headers``, ``keep_alive`` and ``framing`` are set:
    ``"length"`` (a ``Content-Length``, no ``Transfer-Encoding``), ``"chunked"``,
    ``"close"`` (the body runs until the server closes) or ``"none"`` (1xx, 204, 304).
    Body bytes the parser reads go to :attr:`sink`; ``complete`` once the body ended."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._fields: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.keep_alive = False
        self.framing = "close"
        self.content_length: int | None = None
        self.reason = ""
        self.head_done = False
        self.complete = False
        # Body bytes that came with the head; recv.py then points the sink elsewhere.
        self.early = bytearray()
        self.sink: Callable[[bytes], None] = self.early.extend

    def feed(self, data: bytes | bytearray | memoryview) -> bool:
        """Parse ``data``; True once the final head is in (body bytes that came along
        are already in :attr:`sink`)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise HTTPProtocolError("unexpected 101 Switching Protocols") from None
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__ or exc.__cause__
            if isinstance(cause, HTTPProtocolError):
                raise cause from None
            raise
        except httptools.HttpParserError as exc:
            raise HTTPProtocolError(str(exc) or type(exc).__name__) from None
        return self.head_done

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.head_done:
            raise HTTPProtocolError("bytes after the end of the answer")
        self._fields = []  # an interim answer's headers are not the final one's

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # interim (100 Continue, 103 Early Hints): the answer is still to come
        headers: CIMultiDict[str] = CIMultiDict(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self._fields
        )
        self.status, self.headers = status, CIMultiDictProxy(headers)
        self.keep_alive = bool(self._parser.should_keep_alive())
        if status in (204, 304):
            self.framing = "none"
        elif "Transfer-Encoding" in headers:
            # llhttp decodes chunked only as the last coding; anything else runs to the close.
            last = headers.getall("Transfer-Encoding")[-1].rsplit(",", 1)[-1].strip().lower()
            self.framing = "chunked" if last == "chunked" else "close"
        elif "Content-Length" in headers:
            self.framing = "length"  # llhttp has checked it: ASCII digits, one header
            self.content_length = int(headers["Content-Length"])
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.sink(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
