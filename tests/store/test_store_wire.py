"""The blob requests (store/wire.py) against a real server, faults from the proxy.

What it must keep from the botocore path: the same URL as botocore for every
addressing style and endpoint, typed errors from the status and the S3 ``<Code>`` of
the answer, the conditional PUT, checksums, no pinned connection after an error, a
short body or a cancellation, and credentials that rotate under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import (
    AccessDenied,
    BucketNotFound,
    IntegrityError,
    ObjectNotFound,
    PutOutcome,
    S3Store,
    StoreRequestError,
    StoreUnavailable,
)
from ec_s3.store.connection import open_client
from ec_s3.store.error_map import from_status
from ec_s3.store.wire import object_url
from support.faultproxy import FaultProxy

MiB = 1 << 20


@pytest.fixture
def direct(make_store: Callable[..., S3Store]) -> Callable[..., S3Store]:
    def make(endpoint_url: str | None = None, **overrides: Any) -> S3Store:
        store = make_store(endpoint_url, **overrides)
        return store

    return make


# ---------------------------------------------------------------------------- URLs
class _Sent(Exception):
    """Stops a botocore request right before it would leave, carrying its URL."""


@pytest.mark.parametrize(
    ("endpoint_url", "region", "style", "bucket"),
    [
        ("http://127.0.0.1:9000", "us-east-1", "path", "b-1"),
        ("http://127.0.0.1:9000", "us-east-1", "auto", "b-1"),
        ("http://minio.example:9000", "us-east-1", "virtual", "b-1"),
        ("http://minio.example:9000", "us-east-1", "auto", "b-1"),  # an endpoint_url: path style
        (None, "us-west-2", "virtual", "b-1"),  # AWS: the client resolves the regional endpoint
        (None, "eu-central-1", "auto", "b-1"),
        (None, "eu-central-1", "auto", "b.dotted"),  # dots: path style
        (None, "us-east-2", "path", "b-1"),
        # Not compared: us-east-1 on AWS, where botocore sends to the legacy global
        # s3.amazonaws.com and the direct path to client.meta.endpoint_url,
        # s3.us-east-1.amazonaws.com; both serve us-east-1 buckets.
    ],
)
@pytest.mark.parametrize("key", ["ns/abc.safetensors", "odd key/ü~x+y=z&q"])
def test_object_url_is_botocores(endpoint_url: str | None, region: str, style: str, bucket: str, key: str) -> None:
    """The URL (and so the signed path) equals the one botocore sends for the same
    client, for path, virtual and auto addressing, custom endpoints and AWS regions.
    botocore's own request is stopped by its ``before-send`` event, unsent."""
    extra: dict[str, Any] = {"bucket": bucket, "region": region, "addressing_style": style,
                             "access_key_id": "AKIDEXAMPLE", "secret_access_key": "not-a-secret"}
    if endpoint_url:
        extra["endpoint_url"] = endpoint_url
    config = ECS3Config.from_extra_config(extra, environ={})

    def stop(request: Any, **_: Any) -> None:
        raise _Sent(request.url)

    async def urls() -> tuple[str, str]:
        async with contextlib.AsyncExitStack() as stack:
            client, _ = await open_client(config, stack)
            client.meta.events.register("before-send.s3.GetObject", stop)
            with pytest.raises(_Sent) as sent:
                await client.get_object(Bucket=bucket, Key=key)
            ours = object_url(client.meta.endpoint_url, bucket, key, style, custom_endpoint=endpoint_url is not None)
            return str(sent.value.args[0]), ours

    theirs, ours = asyncio.run(urls())
    assert ours == theirs


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("status", "code", "kind", "transient"),
    [
        (404, None, ObjectNotFound, False),  # a HEAD's: no body, no code
        (404, "NoSuchKey", ObjectNotFound, False),
        (404, "NoSuchBucket", BucketNotFound, False),
        (403, "SignatureDoesNotMatch", AccessDenied, False),
        (412, "PreconditionFailed", StoreRequestError, False),
        (503, "SlowDown", StoreUnavailable, True),
        (400, "RequestTimeout", StoreUnavailable, True),
        (400, "InvalidArgument", StoreRequestError, False),
    ],
)
def test_from_status(status: int, code: str | None, kind: type, transient: bool) -> None:
    error = from_status("GET", "k", status, code, "msg")
    assert type(error) is kind and error.transient is transient
    assert (error.status, error.code, error.message) == (status, code, "msg")


def test_error_answers_are_typed_with_status_and_code(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = direct(fault_proxy.endpoint_url, max_attempts=3)
    assert store.run(store.put_async("k", b"x" * 1000), timeout=30) is PutOutcome.CREATED
    fault_proxy.error_next(1, 403, methods=["GET"])
    with pytest.raises(AccessDenied) as denied:
        store.run(store.get_async("k"), timeout=30)
    assert (denied.value.status, denied.value.code) == (403, "AccessDenied")
    with pytest.raises(ObjectNotFound) as missing:
        store.run(store.get_async("missing"), timeout=30)  # the real server's answer
    assert (missing.value.status, missing.value.code) == (404, "NoSuchKey")
    fault_proxy.set_error_rate(1.0, 503, methods=["GET"])
    with pytest.raises(StoreUnavailable) as slow:
        store.run(store.get_async("k"), timeout=30)
    assert (slow.value.status, slow.value.code) == (503, "SlowDown")
    assert store.stats.retries == 2  # 403 never retried, 503 twice
    fault_proxy.clear()
    fault_proxy.error_next(2, 503, methods=["HEAD"])
    assert store.run(store.head_async("k"), timeout=30) is not None  # retried through


def test_conditional_put_412_is_already_exists(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """Bodies sent without ``Expect: 100-continue``: an early refusal of a large body
    must still come back as the answer, not as a reset mid-body."""
    plain = direct()  # straight to the server: the proxy reads whole bodies before forwarding
    data = os.urandom(12 * MiB)  # the largest single PUT (< multipart_threshold_bytes)
    assert plain.run(plain.put_async("k", data), timeout=30) is PutOutcome.CREATED
    assert plain.run(plain.put_async("k", os.urandom(12 * MiB)), timeout=30) is PutOutcome.ALREADY_EXISTS
    store = direct(fault_proxy.endpoint_url)
    fault_proxy.error_next(1, 412, methods=["PUT"])
    assert store.run(store.put_async("k2", b"y" * 10), timeout=30) is PutOutcome.ALREADY_EXISTS
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_large_put_with_wrong_credentials_is_access_denied(direct: Callable[..., S3Store]) -> None:
    store = direct(secret_access_key="wrong-secret", max_attempts=3)
    with pytest.raises(AccessDenied):
        store.run(store.put_async("k", os.urandom(12 * MiB)), timeout=30)
    assert store.stats.retries == 0


# ---------------------------------------------------------------------------- bodies
@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "SHA256"])
@pytest.mark.parametrize("size", [100_000, 20 * MiB])
def test_checksums_round_trip(direct: Callable[..., S3Store], algorithm: str, size: int) -> None:
    """The checksum headers are computed here (single PUT and every part); the server
    accepts them and the CRC metadata comes back. CRC32C went through botocore before
    the direct path computed it (with awscrt, which the config requires for it)."""
    if algorithm == "CRC32C":
        pytest.importorskip("awscrt")
    store = direct(checksum_algorithm=algorithm)
    data = os.urandom(size)
    assert store.run(store.put_async("k", data), timeout=60) is PutOutcome.CREATED
    assert bytes(store.run(store.get_async("k"), timeout=60)) == data
    info = store.run(store.head_async("k"), timeout=30)
    assert info is not None and info.size == size and len(info.metadata["ec-s3-crc32"]) == 8


def test_corrupt_body_is_an_integrity_error(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = direct(fault_proxy.endpoint_url, checksum_algorithm="CRC32")
    data = os.urandom(MiB)
    store.run(store.put_async("k", data), timeout=30)
    fault_proxy.corrupt_next(1, methods=["GET"])
    with pytest.raises(IntegrityError):
        store.run(store.get_async("k"), timeout=30)
    assert store.stats.integrity_failures == 1 and fault_proxy.counters.corrupted == 1
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_body_cut_mid_get_fails_transient_and_frees_the_pool(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """One pooled connection: a GET whose body is cut must not keep it (the HEAD after
    it would wait for the pool, bounded at connect + read timeout, and fail)."""
    store = direct(fault_proxy.endpoint_url, max_pool_connections=1, max_attempts=1, connect_timeout_s=0.5,
                   read_timeout_s=2.0)
    data = os.urandom(6 * MiB)
    store.run(store.put_async("k", data), timeout=30)
    for _ in range(3):
        fault_proxy.truncate_next(1, methods=["GET"])
        with pytest.raises(StoreUnavailable):
            store.run(store.get_async("k"), timeout=30)
    assert fault_proxy.counters.truncated == 3
    assert store.run(store.head_async("k"), timeout=30) is not None
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_cancelled_get_releases_its_connection(direct: Callable[..., S3Store]) -> None:
    """Cancelled while its body streams into the buffer (the caller gave up), a GET
    must close its connection: with a pool of one, every later request waits otherwise."""
    store = direct(max_pool_connections=1, max_attempts=1, connect_timeout_s=0.5, read_timeout_s=2.0)
    data = os.urandom(6 * MiB)
    store.run(store.put_async("k", data), timeout=30)

    async def scenario() -> bool:
        tasks: list[asyncio.Future[Any]] = []

        def allocate(nbytes: int) -> memoryview:
            # The answer's head is in, the body not yet read: cancel at the next await.
            asyncio.get_running_loop().call_soon(tasks[0].cancel)
            return memoryview(bytearray(nbytes))

        for _ in range(3):
            tasks[:] = [asyncio.ensure_future(store.get_async("k", allocate=allocate))]
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
        return await store.head_async("k") is not None

    assert store.run(scenario(), timeout=60)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data


def test_max_blob_bytes_refuses_a_large_object(direct: Callable[..., S3Store], make_store: Callable[..., S3Store]) -> None:
    writer = direct()
    writer.run(writer.put_async("k", os.urandom(4096)), timeout=30)
    reader = direct(max_blob_bytes=1024)
    with pytest.raises(StoreRequestError, match="max_blob_bytes"):
        reader.run(reader.get_async("k"), timeout=30)
    assert reader.run(reader.head_async("k"), timeout=30) is not None  # its connection was not kept


# ---------------------------------------------------------------------------- credentials
@pytest.fixture
def rotating_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """A profile whose ``credential_process`` prints whatever keys the test last wrote,
    expiring within botocore's advisory refresh window: every signing refreshes them
    (RefreshableCredentials, as an instance role's or SSO's would)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    current = tmp_path / "creds.json"
    script = tmp_path / "creds.sh"
    script.write_text(f"#!/bin/sh\ncat {current}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "config").write_text(f"[profile rotating]\ncredential_process = {script}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "nonexistent"))
    monkeypatch.setenv("AWS_PROFILE", "rotating")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    def write(access_key_id: str, secret_access_key: str) -> None:
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=12)
        current.write_text(json.dumps({
            "Version": 1, "AccessKeyId": access_key_id, "SecretAccessKey": secret_access_key,
            "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }))

    yield write


def test_rotated_credentials_are_used(
    s3_endpoint: Any, bucket: str, rotating_credentials: Callable[[str, str], None]
) -> None:
    """Keys rotate under a running store: good, then revoked, then good again. A data
    path that froze the first keys would still succeed with them after the rotation."""
    creds = s3_endpoint.credentials
    rotating_credentials(creds.access_key_id, creds.secret_access_key)
    store = S3Store(ECS3Config.from_extra_config(
        {"bucket": bucket, "endpoint_url": s3_endpoint.url, "max_attempts": 1}, environ={}
    ))
    try:
        assert store.run(store.put_async("k", b"x" * 100), timeout=30) is PutOutcome.CREATED
        assert store.run(store.head_async("k"), timeout=30) is not None
        rotating_credentials(creds.access_key_id, "revoked-" + creds.secret_access_key[:8])
        with pytest.raises(AccessDenied):
            store.run(store.head_async("k"), timeout=30)
        with pytest.raises(AccessDenied):
            store.run(store.get_async("k"), timeout=30)
        rotating_credentials(creds.access_key_id, creds.secret_access_key)
        assert bytes(store.run(store.get_async("k"), timeout=30)) == b"x" * 100
        assert creds.secret_access_key not in repr(store) and creds.secret_access_key not in repr(getattr(store._transport, "wire", None))
    finally:
        store.close(timeout=2)


def test_failing_to_build_the_wire_fails_typed_and_leaves_no_half_store(
    direct: Callable[..., S3Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's client and its direct path are built together: when the second
    cannot be built, the first is closed and the next request tries both again
    once the failure's memory (breaker_cooldown_s) has passed (it once kept the
    client, and every later request died on an assertion)."""
    import ec_s3.store.transport as transport_module

    store = direct(breaker_cooldown_s=0.3)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot build")

    monkeypatch.setattr(transport_module, "DirectWire", refuse)
    for _ in range(2):
        with pytest.raises(StoreRequestError, match="cannot create the S3 client"):
            store.run(store.head_async("k"), timeout=30)
    monkeypatch.undo()
    with pytest.raises(StoreRequestError, match="cannot create the S3 client"):
        store.run(store.head_async("k"), timeout=30)  # remembered: not tried again yet
    time.sleep(0.4)
    assert store.run(store.head_async("k"), timeout=30) is None


# ---------------------------------------------------------------------------- GET into the buffer (recv.py)
def _recv_pool(store: S3Store) -> Any:
    store.run(store.head_async("warm-up"), timeout=30)  # builds the client and the wire
    assert getattr(store._transport, "wire", None) is not None and getattr(store._transport, "wire", None).recv_pool is not None
    return getattr(store._transport, "wire", None).recv_pool


def _cut_every_connection(proxy: FaultProxy) -> None:
    """The server side closes every connection, idle keep-alives included (as a
    server's idle timeout does); the proxy keeps listening."""
    assert proxy._loop is not None
    for task in list(proxy._tasks):
        proxy._loop.call_soon_threadsafe(task.cancel)
    proxy.wait_until(lambda c: not proxy._tasks)


def test_get_body_is_never_held_in_python_objects(direct: Callable[..., S3Store]) -> None:
    """The kernel writes the body into the caller's buffer: no chunk of it is ever a
    Python object (aiohttp's path held 256 KiB-1 MiB of bytes objects at a time)."""
    import tracemalloc

    # One GET of the whole body (ranges of get_range_bytes each add their task's objects).
    store = direct(get_range_bytes=64 * MiB)
    data = os.urandom(16 * MiB)
    store.run(store.put_async("k", data), timeout=60)
    out = memoryview(bytearray(len(data)))
    store.run(store.get_async("k", allocate=lambda n: out), timeout=30)  # a kept connection
    tracemalloc.start()
    try:
        got = store.run(store.get_async("k", allocate=lambda n: out), timeout=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got is out and bytes(out) == data
    assert peak < 128 * 1024, f"{peak} bytes of Python objects allocated during a 16 MiB GET"


def test_sequential_gets_keep_one_connection(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    store = direct(fault_proxy.endpoint_url)
    data = os.urandom(MiB)
    store.run(store.put_async("k", data), timeout=30)
    pool = _recv_pool(store)
    before = fault_proxy.counters.connections
    for _ in range(5):
        assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    assert fault_proxy.counters.connections - before == 1 and pool.opened == 1
    assert (pool.in_use, pool.idle) == (0, 1)


def test_cut_body_closes_its_connection(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """A short body is a transient error, retried by the store on a new connection;
    the cut one is never reused."""
    # One GET, one connection (a GET of get_range_bytes ranges opens one per range).
    store = direct(fault_proxy.endpoint_url, max_attempts=2, get_range_bytes=64 * MiB)
    data = os.urandom(6 * MiB)
    store.run(store.put_async("k", data), timeout=30)
    pool = _recv_pool(store)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    fault_proxy.truncate_next(1, methods=["GET"])
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    assert store.stats.retries == 1 and fault_proxy.counters.truncated == 1
    assert pool.opened == 2 and (pool.in_use, pool.idle) == (0, 1)


def test_error_answers_keep_their_connection(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """A framed error answer is read to its end and its connection kept: a consumer
    polling a promised blob meets a 404 per GET (issue 18 item 5)."""
    store = direct(fault_proxy.endpoint_url, max_attempts=1)
    pool = _recv_pool(store)
    for status, kind in ((403, AccessDenied), (503, StoreUnavailable), (400, StoreRequestError)):
        fault_proxy.error_next(1, status, methods=["GET"])
        with pytest.raises(kind) as err:
            store.run(store.get_async("k"), timeout=30)
        assert err.value.status == status and err.value.code is not None
        assert (pool.in_use, pool.idle) == (0, 1)
    before = fault_proxy.counters.connections
    for _ in range(20):  # SeaweedFS's own 404s
        with pytest.raises(ObjectNotFound):
            store.run(store.get_async("missing"), timeout=30)
    assert fault_proxy.counters.connections == before and pool.opened == 1


def test_cancelled_get_closes_its_socket_and_stops_writing(direct: Callable[..., S3Store]) -> None:
    """Cancelled mid-body: the pool is back to its size, no descriptor is left open,
    and not one more byte lands in the buffer its caller gave up."""
    store = direct(max_attempts=1)
    data = os.urandom(32 * MiB)
    store.run(store.put_async("k", data), timeout=60)
    pool = _recv_pool(store)
    store.run(store.get_async("k"), timeout=30)  # kept connections (one per part): the steady state
    idle_before, fds_before = pool.idle, len(os.listdir("/proc/self/fd"))
    buffers: list[memoryview] = []

    async def scenario() -> None:
        tasks: list[asyncio.Future[Any]] = []

        def allocate(nbytes: int) -> memoryview:
            asyncio.get_running_loop().call_later(0.002, tasks[0].cancel)  # some of the body in
            buffers.append(memoryview(bytearray(nbytes)))
            return buffers[-1]

        for _ in range(5):
            tasks[:] = [asyncio.ensure_future(store.get_async("k", allocate=allocate))]
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
            seen = bytes(buffers[-1])
            await asyncio.sleep(0.2)
            assert bytes(buffers[-1]) == seen, "bytes were written after the GET was cancelled"
        assert (pool.in_use, pool.idle) == (0, 0)

    store.run(scenario(), timeout=60)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == data
    assert (pool.in_use, pool.idle) == (0, idle_before)
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_stalled_get_times_out(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    import time

    from ec_s3.store.errors import StoreTimeout

    store = direct(fault_proxy.endpoint_url, max_attempts=1, read_timeout_s=0.5)
    store.run(store.put_async("k", b"x" * 1000), timeout=30)
    pool = _recv_pool(store)
    fault_proxy.set_stall(True, methods=["GET"])
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.run(store.get_async("k"), timeout=30)
    assert time.monotonic() - started < 5.0  # 0.5 s; the property is that it ends
    assert (pool.in_use, pool.idle) == (0, 0)
    fault_proxy.set_stall(False)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == b"x" * 1000


def test_idle_connection_closed_by_the_server_is_replaced(direct: Callable[..., S3Store], fault_proxy: FaultProxy) -> None:
    """A server's idle timeout closes a kept connection: the next GET goes out on a
    fresh one, without using up an attempt."""
    store = direct(fault_proxy.endpoint_url, max_attempts=1)
    store.run(store.put_async("k", b"y" * 1000), timeout=30)
    pool = _recv_pool(store)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == b"y" * 1000
    _cut_every_connection(fault_proxy)
    assert bytes(store.run(store.get_async("k"), timeout=30)) == b"y" * 1000
    # Reset as the request arrives (the close raced it): resent once on a fresh one.
    fault_proxy.reset_next(1, methods=["GET"])
    assert bytes(store.run(store.get_async("k"), timeout=30)) == b"y" * 1000
    assert fault_proxy.counters.resets == 1 and store.stats.retries == 0 and pool.opened == 3


# ---------------------------------------------------------------------------- TLS
@pytest.fixture
def tls_endpoint(https_endpoint: Any) -> str:
    """``https://127.0.0.1:<port>`` whose certificate no default trust store accepts."""
    return str(https_endpoint.url)


def test_get_over_tls_reads_into_the_buffer(direct: Callable[..., S3Store], tls_endpoint: str) -> None:
    """asyncio's TLS transport feeds a BufferedProtocol: the GET pool serves https too."""
    store = direct(tls_endpoint, verify_tls=False)
    pool = _recv_pool(store)
    for size in (1000, 6 * MiB, 20 * MiB):
        data = os.urandom(size)
        store.run(store.put_async(f"k{size}", data), timeout=60)
        assert bytes(store.run(store.get_async(f"k{size}"), timeout=60)) == data
    assert pool.opened >= 1 and pool.in_use == 0


def test_unverifiable_certificate_is_a_tls_error(direct: Callable[..., S3Store], tls_endpoint: str) -> None:
    from ec_s3.store.errors import TLSError

    store = direct(tls_endpoint, verify_tls=True, max_attempts=1)
    with pytest.raises(TLSError):
        store.run(store.get_async("k"), timeout=30)
    with pytest.raises(TLSError):
        store.run(store.head_async("k"), timeout=30)
