"""A GET takes exactly the bytes it asked for, or fails typed.

Against a scripted raw server (tests/support/scripted_http.py): a 206 of another range,
malformed numbers. Against SeaweedFS: a blob replaced between the ranges of one GET is
never a blend (``If-Match``). Legal but unusual HTTP/1.1 answers: tests/store/test_store_http1.py.
"""

from __future__ import annotations

from collections.abc import Callable

import boto3
import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import S3Store
from ec_s3.store.errors import ObjectChanged, StoreError, StoreUnavailable
from ec_s3.store.ranges import check_answer, parse_content_length, parse_content_range
from support.s3_matrix import S3Endpoint, s3_matrix
from tests.support.scripted_http import ScriptedHTTP, answer, get_bytes, header

BODY = b"hello world!"  # 12 bytes
MiB = 1 << 20


PARTIAL = b"206 Partial Content"
WRONG_ANSWERS = {
    # asked 0-..., answered the second half: the bytes 6-11 taken as 0-5 (issue 18 item 3)
    "another range": answer(PARTIAL, [b"Content-Range: bytes 6-11/12", b"Content-Length: 6"], BODY[6:]),
    "a shorter range": answer(PARTIAL, [b"Content-Range: bytes 0-5/12", b"Content-Length: 6"], BODY[:6]),
    "no Content-Range": answer(PARTIAL, [b"Content-Length: 12"], BODY),
    "range and length disagree": answer(PARTIAL, [b"Content-Range: bytes 0-11/12", b"Content-Length: 11"], BODY[:11]),
    # str.isdigit() accepts ² and int() then raises an untyped ValueError
    "superscript total": answer(PARTIAL, ["Content-Range: bytes 0-11/1²".encode("latin-1"), b"Content-Length: 12"], BODY),
}


@pytest.mark.parametrize("name", sorted(WRONG_ANSWERS))
def test_an_answer_that_is_not_the_asked_range_fails_typed(make_store: Callable[..., S3Store], name: str) -> None:
    with ScriptedHTTP(lambda n, head: WRONG_ANSWERS[name]) as server:
        store = make_store(server.url, max_attempts=1)
        with pytest.raises(StoreError) as caught:
            get_bytes(store)
        assert isinstance(caught.value, StoreUnavailable), repr(caught.value)


def test_parsers_take_ascii_digits_only() -> None:
    assert parse_content_length("12") == 12
    assert parse_content_length("12, 12") == 12
    assert parse_content_length("12, 13") is None
    assert parse_content_length("²") is None and parse_content_length("١٢") is None
    assert parse_content_range("bytes 0-11/12") == (0, 11, 12)
    assert parse_content_range("bytes 0-11/*") == (0, 11, None)
    assert parse_content_range("bytes ٠-11/12") is None
    with pytest.raises(StoreUnavailable):
        check_answer(206, {"Content-Range": "bytes 1-12/13"}, 0, 12, "k")
    with pytest.raises(StoreUnavailable):
        check_answer(200, {"Content-Length": "12"}, 6, 11, "k")  # a later range answered whole


# -- a blob replaced between the ranges of one GET, on SeaweedFS ------------------------------

def _raw_client(config: ECS3Config) -> object:
    assert config.access_key_id is not None and config.secret_access_key is not None
    return boto3.client(
        "s3", endpoint_url=config.endpoint_url, region_name="us-east-1",
        aws_access_key_id=config.access_key_id.reveal(), aws_secret_access_key=config.secret_access_key.reveal(),
    )


def _replacing_allocator(config: ECS3Config, key: str, new: bytes) -> Callable[[int], memoryview]:
    """An allocator that, once the first range has answered, overwrites the object (as a
    second writer would) before the later ranges are asked for."""
    def allocate(nbytes: int) -> memoryview:
        _raw_client(config).put_object(Bucket=config.bucket, Key=key, Body=new)  # type: ignore[attr-defined]
        return memoryview(bytearray(nbytes))

    return allocate


def test_a_blob_replaced_between_ranges_is_never_a_blend(make_store: Callable[..., S3Store]) -> None:
    store = make_store(get_range_bytes=5 * MiB, multipart_threshold_bytes=64 * MiB)
    old, new = b"a" * (12 * MiB), b"b" * (12 * MiB)
    store.run(store.put_async("k", old), timeout=60)
    got = store.run(store.get_async("k", allocate=_replacing_allocator(store.config, "k", new)), timeout=60)
    assert bytes(got) == new  # restarted once on the 412, the new object whole


def test_a_blob_replaced_by_another_size_is_object_changed(make_store: Callable[..., S3Store]) -> None:
    store = make_store(get_range_bytes=5 * MiB, multipart_threshold_bytes=64 * MiB)
    store.run(store.put_async("k", b"a" * (12 * MiB)), timeout=60)
    with pytest.raises(ObjectChanged):
        store.run(store.get_async("k", allocate=_replacing_allocator(store.config, "k", b"c" * (11 * MiB))), timeout=60)


def test_later_ranges_carry_if_match(make_store: Callable[..., S3Store]) -> None:
    total = 6 * MiB
    data = bytes(range(256)) * (total // 256)

    def script(n: int, head: bytes) -> bytes:
        first, last = (int(v) for v in header(head, b"Range")[len(b"bytes="):].split(b"-"))  # type: ignore[index]
        last = min(last, total - 1)
        if n > 0 and header(head, b"If-Match") != b'"v1"':
            return answer(b"400 Bad Request", [b"Content-Length: 0"], b"")
        return answer(PARTIAL, [b"Content-Range: bytes %d-%d/%d" % (first, last, total),
                                 b"Content-Length: %d" % (last - first + 1), b'ETag: "v1"'], data[first : last + 1])

    with ScriptedHTTP(script) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=5 * MiB)
        assert get_bytes(store) == data
        assert len(server.requests) == 2


def test_later_ranges_go_out_while_the_first_body_is_read(make_store: Callable[..., S3Store]) -> None:
    """Issue 19 item 4: the first range's body must not go alone. The server sends the
    first answer's head and half its body, then holds the rest until a later range is
    asked for (5 s at most): read in turn, the later ranges came only after it."""
    import threading
    import time

    total, part = 12 * MiB, 5 * MiB
    data = bytes(range(256)) * (total // 256)
    later_asked = threading.Event()
    overlapped: list[bool] = []

    def script(n: int, head: bytes) -> object:
        first, last = (int(v) for v in header(head, b"Range")[len(b"bytes="):].split(b"-"))  # type: ignore[index]
        last = min(last, total - 1)
        whole = answer(PARTIAL, [b"Content-Range: bytes %d-%d/%d" % (first, last, total),
                                 b"Content-Length: %d" % (last - first + 1), b'ETag: "v1"'], data[first : last + 1])
        if n > 0:
            later_asked.set()
            return whole
        split = len(whole) - (last - first + 1) // 2

        def send(conn: object) -> None:
            conn.sendall(whole[:split])  # type: ignore[attr-defined]
            started = time.monotonic()
            overlapped.append(later_asked.wait(5.0) and time.monotonic() - started < 5.0)
            conn.sendall(whole[split:])  # type: ignore[attr-defined]

        return send

    with ScriptedHTTP(script) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=part, request_timeout_s=30)
        assert get_bytes(store) == data
        assert len(server.requests) == 3
    assert overlapped == [True], "the later ranges waited for the whole first body"


# -- the two phases of a GET: open (the size), then read_into the caller's buffer -------------

def test_open_gives_the_size_then_reads_into_the_callers_buffer(make_store: Callable[..., S3Store]) -> None:
    """Three ranges (5 MiB parts): the size comes with the first answer, the bytes only
    into a buffer of exactly that size; opens left unread (more than the pool) hold no
    connection once closed."""
    store = make_store(get_range_bytes=5 * MiB, multipart_threshold_bytes=64 * MiB, max_pool_connections=2)
    data = bytes(range(256)) * (12 * MiB // 256)
    store.run(store.put_async("k", data), timeout=60)

    async def two_phases() -> bytes:
        for _ in range(4):  # opened, never read: released on exit
            async with store.open_async("k") as unread:
                assert unread.size == len(data)
        async with store.open_async("k") as download:
            with pytest.raises(ValueError):
                await download.read_into(memoryview(bytearray(download.size - 1)))
            out = memoryview(bytearray(download.size))
            await download.read_into(out)
        return bytes(out)

    assert store.run(two_phases(), timeout=60) == data


# -- issue 24 item 2: every range from one object, whatever the server does with If-Match ----

def _versions(old: bytes, new: bytes, etags: tuple[bytes | None, bytes | None], *, weak_412: bool = False
              ) -> Callable[[int, bytes], bytes]:
    """A server that ignores ``If-Match`` (or, with ``weak_412``, compares it strongly: a
    weak tag never matches, RFC 9110 13.1.1): the first request gets ``old`` with
    ``etags[0]``, every later one the replaced object ``new`` with ``etags[1]``."""
    from tests.support.scripted_http import serve_range

    def script(n: int, head: bytes) -> bytes:
        data, etag = (old, etags[0]) if n == 0 else (new, etags[1])
        if weak_412 and (header(head, b"If-Match") or b"").startswith(b"W/"):
            return answer(b"412 Precondition Failed", [b"Content-Length: 0"], b"")
        return serve_range(head, data, etag)

    return script


OLD, NEW = b"a" * (6 * MiB), b"b" * (6 * MiB)


def test_a_later_range_of_a_replaced_object_is_never_a_blend_even_if_if_match_is_ignored(
    make_store: Callable[..., S3Store],
) -> None:
    """Failed before (both paths): the later range's ETag was never compared with the
    first answer's, so a server that ignores If-Match gave 5 MiB + 64 KiB of the old
    object and the rest of the new one. Now: the 412 path, restarted once, the new
    object whole."""
    with ScriptedHTTP(_versions(OLD, NEW, (b'"v1"', b'"v2"'))) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=5 * MiB)
        assert get_bytes(store) == NEW
        assert len(server.requests) == 4  # two ranges, then both again


def test_an_object_that_keeps_changing_is_object_changed(make_store: Callable[..., S3Store]) -> None:
    from tests.support.scripted_http import serve_range

    with ScriptedHTTP(lambda n, head: serve_range(head, OLD if n % 2 else NEW, b'"v%d"' % n)) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=5 * MiB)
        with pytest.raises(ObjectChanged):
            get_bytes(store)


@pytest.mark.parametrize("etag", [None, b'W/"v1"'], ids=["no ETag", "weak ETag"])
def test_an_object_without_a_strong_etag_is_read_with_one_unranged_get(
    make_store: Callable[..., S3Store], etag: bytes | None,
) -> None:
    """Failed before (both paths): with no ETag no If-Match was sent and the later range
    came from the replaced object (a blend); with a weak one every multi-range GET met
    412 (a strong If-Match never matches a weak tag) and ended as ObjectChanged. Two
    ranged answers of such an object cannot be told to be the same object: it is read
    with one unranged GET."""
    with ScriptedHTTP(_versions(OLD, NEW, (etag, etag), weak_412=True)) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=5 * MiB)
        assert get_bytes(store) == NEW
        assert len(server.requests) == 2
        assert header(server.requests[1], b"Range") is None and header(server.requests[1], b"If-Match") is None


@pytest.mark.parametrize("etag", [None, b'W/"v1"'], ids=["no ETag", "weak ETag"])
def test_a_one_range_object_without_a_strong_etag_takes_one_request(
    make_store: Callable[..., S3Store], etag: bytes | None,
) -> None:
    from tests.support.scripted_http import serve_range

    with ScriptedHTTP(lambda n, head: serve_range(head, BODY, etag)) as server:
        store = make_store(server.url, max_attempts=1)
        assert get_bytes(store) == BODY
        assert len(server.requests) == 1


@s3_matrix()
def test_each_server_sends_one_strong_etag_on_every_range(s3: S3Endpoint, bucket: str) -> None:
    """What docs/compatibility.md says of each server: ranged GETs of a single PUT and of
    a multipart object carry a strong, quoted ETag, the same on every range and on HEAD
    (so ec-s3 reads them with parallel ranges, not one unranged GET), and a wrong
    If-Match is a 412."""
    import botocore.exceptions

    from ec_s3.store.download import strong_etag

    raw = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1",
                       verify=str(s3.ca_bundle) if s3.ca_bundle else None,
                       aws_access_key_id=s3.credentials.access_key_id,
                       aws_secret_access_key=s3.credentials.secret_access_key)
    raw.put_object(Bucket=bucket, Key="single", Body=b"x" * (6 * MiB))
    upload = raw.create_multipart_upload(Bucket=bucket, Key="multi")["UploadId"]
    parts = [{"PartNumber": i, "ETag": raw.upload_part(Bucket=bucket, Key="multi", UploadId=upload, PartNumber=i,
                                                       Body=b"y" * (5 * MiB))["ETag"]} for i in (1, 2)]
    raw.complete_multipart_upload(Bucket=bucket, Key="multi", UploadId=upload, MultipartUpload={"Parts": parts})
    for key in ("single", "multi"):
        head = raw.head_object(Bucket=bucket, Key=key)["ResponseMetadata"]["HTTPHeaders"]["etag"]
        tags = {raw.get_object(Bucket=bucket, Key=key, Range=r)["ResponseMetadata"]["HTTPHeaders"]["etag"]
                for r in ("bytes=0-99", f"bytes={5 * MiB}-{5 * MiB + 99}")}
        assert tags == {head} and strong_etag(head) and head.startswith('"'), (key, tags, head)
        with pytest.raises(botocore.exceptions.ClientError) as caught:
            raw.get_object(Bucket=bucket, Key=key, Range="bytes=100-199", IfMatch='"not-it"')
        assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


# -- issue 42: a GET of a known size asks every range at once ---------------------------------

def _sized(store: S3Store, expected: int) -> bytes:
    return bytes(store.run(store.get_async("k", expected_size=expected), timeout=60))


def test_a_known_size_sends_every_range_before_any_answer(make_store: Callable[..., S3Store]) -> None:
    """Failed before (no expected size existed): the first answer had to come back
    before a later range was asked, a round trip per blob on a network. The server
    holds every answer until all four ranges of the 8 MiB blob have been asked (5 s at
    most)."""
    import threading
    import time

    from tests.support.scripted_http import serve_range

    data = bytes(range(256)) * (8 * MiB // 256)
    asked, lock, waited = [0], threading.Lock(), []
    all_asked = threading.Event()

    def script(n: int, head: bytes) -> object:
        with lock:
            asked[0] += 1
            if asked[0] == 4:
                all_asked.set()

        def send(conn: object) -> None:
            started = time.monotonic()
            waited.append(all_asked.wait(5.0) and time.monotonic() - started < 5.0)
            conn.sendall(serve_range(head, data, b'"v1"'))  # type: ignore[attr-defined]

        return send

    with ScriptedHTTP(script) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=2 * MiB, request_timeout_s=30)
        assert _sized(store, len(data)) == data
        assert len(server.requests) == 4 and all(waited)


@pytest.mark.parametrize("guess", [0.5, 0.999, 1.0, 1.5, 3.0])
def test_a_wrong_guess_costs_requests_never_bytes(make_store: Callable[..., S3Store], guess: float) -> None:
    """An expected size too small asks the rest once the first answer tells the size;
    one too large meets ranges past the end (416) or cut short by it: the blob whole
    either way, on SeaweedFS."""
    store = make_store(get_range_bytes=1 * MiB)
    data = bytes(range(256)) * (5 * MiB // 256) + b"tail"
    store.run(store.put_async("k", data), timeout=60)
    assert _sized(store, int(len(data) * guess)) == data
    assert store.stats.retries == 0


def test_a_known_size_replaced_between_ranges_is_never_a_blend(make_store: Callable[..., S3Store]) -> None:
    """Every range asked at once, no If-Match yet: the answer that came first is old,
    the others new; their ETags differ, so the GET starts again and gives NEW whole."""
    with ScriptedHTTP(_versions(OLD, NEW, (b'"v1"', b'"v2"'))) as server:
        store = make_store(server.url, max_attempts=1, get_range_bytes=2 * MiB)
        assert _sized(store, len(NEW)) == NEW


def test_ranges_are_planned_equal_and_bounded() -> None:
    from ec_s3.store.download import plan_ranges

    assert plan_ranges(0, 10, 4, 16) == [(0, 3), (3, 6), (6, 10)]
    assert plan_ranges(0, 100, 1, 4) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert plan_ranges(0, 2 * MiB + 100, 2 * MiB, 16, slack=64 * 1024) == [(0, 2 * MiB + 100)]
    assert plan_ranges(5, 6, 4, 16) == [(5, 6)]
