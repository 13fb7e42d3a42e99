"""Legal but unusual HTTP/1.1 answers give the bytes, malformed ones a typed error, on both data paths.

A scripted raw server (tests/support/scripted_http.py) sends what S3 servers and
gateways may send: interim 1xx answers before the real one, chunked 200/206, a 200
for the whole object. The parser behind each path is llhttp (store/http1.py on the
direct path, aiohttp's under aiobotocore). Range checks: tests/test_store_ranges.py;
the pool's framing: tests/test_store_recv.py.
"""

from __future__ import annotations

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
}


@pytest.mark.parametrize("name", sorted(GOOD_ANSWERS))
def test_legal_answers_give_the_bytes(path_store: Callable[..., S3Store], name: str) -> None:
    with ScriptedHTTP(lambda n, head: GOOD_ANSWERS[name]) as server:
        store = path_store(server.url, max_attempts=1, read_timeout_s=5.0)
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
    "length and chunked": answer(b"200 OK", [b"Content-Length: 12", b"Transfer-Encoding: chunked"], b"c\r\n" + BODY + b"\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_answers_fail_typed(path_store: Callable[..., S3Store], name: str) -> None:
    with ScriptedHTTP(lambda n, head: MALFORMED[name]) as server:
        store = path_store(server.url, max_attempts=1, read_timeout_s=1.0)
        with pytest.raises(StoreError) as caught:
            get_bytes(store)
        assert isinstance(caught.value, StoreUnavailable), repr(caught.value)
