"""An HTTP/1.1 answer read by llhttp (httptools): its head, framing and whether its connection may be kept.

Owns :class:`Answer`, fed the bytes of one exchange as they arrive (sans-I/O): it skips
interim ``1xx`` answers, knows the final head (status, headers, keep-alive) and how its body
is framed (:attr:`Answer.framing`), and hands the bodies the parser reads itself (chunked,
error answers) to a sink. Does not own sockets, timeouts and the zero-copy path for a body of
known length (:mod:`.recv`), nor what an answer means (:mod:`.errors`, :mod:`.ranges`).
"""

from __future__ import annotations

import datetime
import email.utils
from collections.abc import Callable, Mapping

from botocore.utils import parse_timestamp

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["MAX_FIELD_BYTES", "Answer", "HTTPProtocolError", "is_error_status", "coding_error", "parse_http_date", "parse_retry_after", "parse_timestamp_or_none"]


#: The longest header line (name and value) accepted: aiohttp's limit, which HEAD, PUT and
#: the aiobotocore client's answers meet in aiohttp's parser.
MAX_FIELD_BYTES = 8190


def is_error_status(status: int) -> bool:
    """Whether an answer is an error answer (its body an S3 error document, its status
    a typed error by :func:`.error_map.from_status`), on every path: 300 and up. A 2xx
    that is not what a request asks for (a 204 to a GET) is its caller's to refuse,
    as a malformed answer (:func:`.ranges.check_answer`)."""
    return status >= 300


class HTTPProtocolError(Exception):
    """The bytes are not a well-formed HTTP/1.1 answer (or more came than one answer)."""


def coding_error(headers: Mapping[str, str]) -> str | None:
    """Why an answer's ``Transfer-Encoding`` cannot be read, or None: a body is either
    of known length or ``chunked`` alone. Any other coding (``gzip, chunked``) would hand
    the caller still-encoded bytes as the object's, so it is refused here."""
    getall = getattr(headers, "getall", None)
    values = getall("Transfer-Encoding", []) if getall is not None else [headers.get("Transfer-Encoding") or ""]
    codings = [c.strip().lower() for v in values for c in v.split(",") if c.strip()]
    if codings and codings != ["chunked"]:
        return f"Transfer-Encoding {', '.join(codings)!r}: a body may only be chunked, not otherwise encoded"
    return None


def parse_http_date(value: str | None) -> float | None:
    """Epoch seconds of a date header (``Last-Modified``): an IMF-fixdate or one of
    HTTP's obsolete forms, else as botocore reads it (ISO 8601, epoch seconds); None
    when absent or unreadable (never an exception: the date is information, not the
    answer)."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        pass
    try:
        return float(parse_timestamp(value).timestamp())
    except Exception:  # noqa: BLE001 - dateutil raises several kinds, all meaning "not a date"
        return None


def parse_timestamp_or_none(value: str) -> datetime.datetime | None:
    """botocore's timestamp parser (its ``timestamp_parser`` for the client's answers:
    a listing's ``LastModified``), None where botocore's would raise an untyped
    ValueError from the whole response (a date that is no date)."""
    try:
        return parse_timestamp(value)
    except Exception:  # noqa: BLE001 - dateutil raises several kinds, all meaning "not a date"
        return None


def parse_retry_after(value: str | None, now: float) -> float | None:
    """The seconds a ``Retry-After`` asks to wait (delta-seconds, or an HTTP-date less
    ``now``, epoch seconds), at least 0; None when absent or unreadable."""
    value = (value or "").strip()
    if value.isascii() and value.isdigit():
        return float(value)
    when = parse_http_date(value) if value else None
    return None if when is None else max(0.0, when - now)


class Answer:
    """One request's answer, parsed as its bytes are fed. After :meth:`feed` reports the
    head, ``status``, ``headers``, ``keep_alive`` and ``framing`` are set:
    ``"length"`` (a ``Content-Length``, no ``Transfer-Encoding``), ``"chunked"``,
    ``"close"`` (the body runs until the server closes) or ``"none"`` (1xx, 204, 304).
    Body bytes the parser reads go to :attr:`sink`; ``complete`` once the body ended."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        # What aiohttp's parser (HEAD's, PUT's, the client's) does for answers: lenient header
        # values, so obs-fold (RFC 9112 5.2: a user agent must accept it) is one value
        # with its fold as spaces; the NUL and bare line ends that leniency lets through
        # are refused in on_header, as aiohttp refuses NUL.
        self._parser.set_dangerous_leniencies(lenient_headers=True)
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
        if len(name) + len(value) > MAX_FIELD_BYTES:
            raise HTTPProtocolError(f"a header line over {MAX_FIELD_BYTES} bytes")
        if b"\x00" in value or b"\r" in value or b"\n" in value:
            raise HTTPProtocolError("a control character in a header value")
        self._fields.append((name, value.rstrip(b" \t")))

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
