"""Legal but unusual HTTP/1.1 answers give the bytes, malformed ones a typed error.

A scripted raw server (tests/support/scripted_http.py) sends what S3 servers and
gateways may send: interim 1xx answers before the real one, chunked 200/206, a 200
for the whole object. The parser is llhttp (store/http1.py for GETs, aiohttp's for
HEAD and PUT). Range checks: tests/store/test_store_ranges.py;
the pool's framing: tests/store/test_store_recv.py.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable

import pytest

from ec_s3.store.client import S3Store
from ec_s3.store.errors import StoreError, StoreUnavailable
from tests.support.scripted_http import ScriptedHTTP, answer, get_bytes

BODY = b"hello world!"  # 12 bytes
PARTIAL = b"206 Partial Content"


GOOD_ANSWERS = {
    "plain": answer(PARTIAL, [b"Content-Range: bytes 0-11/12", b"Content-Length: 12"], BODY),
    "interim 100 and 103 first": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    + answer(PARTIAL, [b"Content-Range: bytes 0-11/12", b"Content-Length: 12"], BODY),
    "chunked 200": answer(b"200 OK", [b"Transfer-Encoding: chunked"], b"5\r\nhello\r\n7\r\n world!\r\n0\r\n\r\n"),
    "chunked 206": answer(
        PARTIAL, [b"Content-Range: bytes 0-11/12", b"Transfer-Encoding: chunked"], b"c\r\nhello world!\r\n0\r\n\r\n"
    ),
    "whole object 200": answer(b"200 OK", [b"Content-Length: 12"], BODY),
    # RFC 9112 5.2: a user agent must accept obs-fold (issue 24: refused, as transient, on direct)
    "obs-fold header": answer(
        PARTIAL, [b"Content-Range: bytes 0-11/12", b"x-amz-meta-folded: one", b"  two", b"Content-Length: 12"], BODY
    ),
}


@pytest.mark.parametrize("name", sorted(GOOD_ANSWERS))
def test_legal_answers_give_the_bytes(make_store: Callable[..., S3Store], name: str) -> None:
    with ScriptedHTTP(lambda n, head: GOOD_ANSWERS[name]) as server:
        store = make_store(server.url, max_attempts=1, read_timeout_s=5.0)
        assert get_bytes(store) == BODY  # also builds the client: not timed
        started = time.monotonic()
        assert get_bytes(store) == BODY
        assert time.monotonic() - started < 2.5  # an interim answer is not taken as the final one



MALFORMED = {
    # str.isdigit() accepted it, int() then raised an untyped ValueError (also from the start-up check)
    "superscript length": answer(PARTIAL, [b"Content-Range: bytes 0-11/12", "Content-Length: ²".encode("latin-1")], BODY),
    # RFC 9110 8.6 allows identical repeats but lets a recipient refuse them; llhttp
    # does, on both paths (store/http1.py says why that parser): typed, never a wrong byte.
    "repeated identical length": answer(
        PARTIAL, [b"Content-Range: bytes 0-11/12", b"Content-Length: 12", b"Content-Length: 12"], BODY
    ),
    "transfer coding other than chunked": answer(b"200 OK", [b"Transfer-Encoding: gzip"], BODY),
    # issue 24: llhttp decodes the final chunked and hands over the gzip bytes as the object's (both paths)
    "gzip, then chunked": answer(b"200 OK", [b"Transfer-Encoding: gzip, chunked"], b"c\r\n" + BODY + b"\r\n0\r\n\r\n"),
    "gzip, then chunked, on two lines": answer(
        PARTIAL, [b"Content-Range: bytes 0-11/12", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked"],
        b"c\r\n" + BODY + b"\r\n0\r\n\r\n",
    ),
    # issue 24: one rule each on both paths (store/http1.py); before, direct called a 204
    # non-transient and took a 20 KB line, botocore called the 204 transient and refused the line
    "204 to a GET": answer(b"204 No Content", [], b""),
    "a 20 KB header line": answer(
        PARTIAL, [b"Content-Range: bytes 0-11/12", b"Content-Length: 12", b"x-amz-meta-big: " + b"a" * 20_000], BODY
    ),
    "length and chunked": answer(b"200 OK", [b"Content-Length: 12", b"Transfer-Encoding: chunked"], b"c\r\n" + BODY + b"\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_answers_fail_typed(make_store: Callable[..., S3Store], name: str) -> None:
    with ScriptedHTTP(lambda n, head: MALFORMED[name]) as server:
        store = make_store(server.url, max_attempts=1, read_timeout_s=1.0)
        with pytest.raises(StoreError) as caught:
            get_bytes(store)
        assert isinstance(caught.value, StoreUnavailable), repr(caught.value)


LAST_MODIFIED = {
    "IMF-fixdate": (b"Wed, 02 Dec 2026 15:00:00 GMT", 1796223600.0),
    "ISO 8601, as botocore accepts": (b"2026-12-02T15:00:00.000Z", 1796223600.0),
    "garbage": (b"yesterday-ish", None),
}


@pytest.mark.parametrize("name", sorted(LAST_MODIFIED))
def test_a_last_modified_of_any_form_is_read_or_ignored(make_store: Callable[..., S3Store], name: str) -> None:
    """Failed before (issue 24): ISO 8601 and garbage were an untyped ValueError from
    head_async on the direct path; garbage failed the botocore path too."""
    value, expected = LAST_MODIFIED[name]
    head = answer(b"200 OK", [b"Content-Length: 12", b"ETag: \"e\"", b"Last-Modified: " + value], b"")
    with ScriptedHTTP(lambda n, request: head) as server:
        store = make_store(server.url, max_attempts=1, read_timeout_s=5.0)
        info = store.run(store.head_async("k"), timeout=30)
    assert info is not None and info.size == 12
    if expected is None:
        assert abs(info.last_modified - time.time()) < 60  # unknown: as when absent
    else:
        assert info.last_modified == expected


_SLOW_DOWN_BODY = b"<Error><Code>SlowDown</Code><Message>m</Message></Error>"
SLOW_DOWN = answer(b"503 Slow Down", [b"Content-Length: %d" % len(_SLOW_DOWN_BODY), b"Retry-After: %s"],
                   _SLOW_DOWN_BODY)
GOOD = GOOD_ANSWERS["plain"]


@pytest.mark.parametrize("wait", [b"1", b"date"])
def test_retry_after_on_slow_down_is_honoured(make_store: Callable[..., S3Store], wait: bytes) -> None:
    """Failed before (issue 24): the retry came after the back-off alone (36-166 ms)."""
    arrivals: list[float] = []

    def script(n: int, head: bytes) -> bytes:
        arrivals.append(time.monotonic())
        if n == 1:  # n == 0 is the GET that builds the client and succeeds
            value = b"1" if wait == b"1" else email.utils.formatdate(time.time() + 2, usegmt=True).encode()
            return SLOW_DOWN.replace(b"%s", value)
        return GOOD

    with ScriptedHTTP(script) as server:
        store = make_store(server.url, max_attempts=3, read_timeout_s=5.0, request_timeout_s=10.0)
        assert get_bytes(store) == BODY
        assert get_bytes(store) == BODY
    assert len(arrivals) == 3 and arrivals[2] - arrivals[1] >= 0.95


def test_retry_after_past_the_deadline_ends_the_request(make_store: Callable[..., S3Store]) -> None:
    """A wait longer than request_timeout_s is not waited out, nor cut short: the
    request fails at once with the server's transient error."""
    with ScriptedHTTP(lambda n, head: GOOD if n == 0 else SLOW_DOWN.replace(b"%s", b"30")) as server:
        store = make_store(server.url, max_attempts=4, read_timeout_s=5.0, request_timeout_s=5.0)
        assert get_bytes(store) == BODY
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            get_bytes(store)
        assert time.monotonic() - started < 2.0 and len(server.requests) == 2
    assert caught.value.code == "SlowDown" and caught.value.retry_after_s == 30.0
