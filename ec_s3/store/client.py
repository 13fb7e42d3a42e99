"""The S3 store: blob operations on one bucket, with retries and a concurrency bound.

All requests run on the process-wide background loop (:mod:`ec_s3.loop`); the
``*_async`` coroutines are for code already on that loop, and :meth:`S3Store.submit`
hands one to it from any thread without blocking. Owns the operations (HEAD, PUT,
multipart, ranged GET, DELETE, LIST), the retry loop (exponential back-off with full
jitter, only on throttling, 5xx and connection errors, never on 4xx, so that a budget
bounds the time a caller can wait), the concurrency bound (``max_concurrency``
requests; since single requests carry at most ``multipart_threshold_bytes`` and parts
at most ``multipart_part_bytes``, that also bounds the bytes in flight) and the
process-wide cache of shared stores, and which path each request takes: with
``data_path: direct`` (the default) HEAD, single PUT, UploadPart and GET go through
:mod:`.wire` (botocore-signed, ec-s3's own aiohttp pool), everything else (and every
request with ``data_path: botocore``, or a checksum algorithm only botocore computes)
through the aiobotocore client. Does not own building the client (:mod:`.connection`),
sending the direct requests (:mod:`.wire`), the error types and their mapping
(:mod:`.errors`), the circuit breaker (:mod:`.breaker`), request bodies
(:mod:`.body`) or the steps of a multipart upload and its aborts (:mod:`.multipart`);
their names are re-exported here for importers of this module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import email.utils
import hashlib
import hmac
import random
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from ec_s3.blob.format import MAX_HEADER_BYTES
from ec_s3.config import ECS3Config, Secret
from ec_s3.log import logger
from ec_s3.loop import BackgroundLoop, shared_loop
from ec_s3.store.body import CHECKSUM_HEADERS as _CHECKSUM_HEADERS
from ec_s3.store.body import Body, BufferChain, ChainReader, crc32_of, sha256_of
from ec_s3.store.breaker import CircuitBreaker
from ec_s3.store.connection import open_client, resolve_endpoint
from ec_s3.store.errors import (
    AccessDenied,
    BucketNotFound,
    CircuitOpen,
    IntegrityError,
    NoCredentials,
    ObjectChanged,
    ObjectNotFound,
    PutOutcome,
    StoreBusy,
    StoreClosed,
    StoreConfigError,
    StoreError,
    StoreRequestError,
    StoreTimeout,
    StoreUnavailable,
    StoreUnreachable,
    TLSError,
)
from ec_s3.store.error_map import to_store_error
from ec_s3.store.multipart import put_multipart
from ec_s3.store.ranges import BotocoreAnswer, check_answer
from ec_s3.store.slots import Slots
from ec_s3.store.tasks import all_or_none as _all_or_none
from ec_s3.store.wire import DirectWire, GetAnswer

__all__ = [
    "AccessDenied",
    "Body",
    "BucketNotFound",
    "BufferChain",
    "CRC_METADATA_KEY",
    "CircuitBreaker",
    "CircuitOpen",
    "DELETE_BATCH",
    "IntegrityError",
    "NoCredentials",
    "ObjectChanged",
    "ObjectInfo",
    "ObjectNotFound",
    "PutOutcome",
    "S3Store",
    "StoreClosed",
    "StoreConfigError",
    "StoreError",
    "StoreRequestError",
    "StoreStats",
    "StoreTimeout",
    "StoreUnavailable",
    "StoreUnreachable",
    "TLSError",
]

T = TypeVar("T")
Allocator = Callable[[int], memoryview]



class _CallerError(Exception):
    """Carries an exception of the caller's own code (an allocator) through the request
    loop, which would otherwise take an OSError for a network failure and retry it."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


CRC_METADATA_KEY = "ec-s3-crc32"


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""
    last_modified: float = 0.0  # epoch seconds
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StoreStats:
    """Counters since start; updated on the loop thread only, read from anywhere."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    short_circuited: int = 0
    integrity_failures: int = 0
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    abandoned_uploads: int = 0  # multipart uploads whose aborts kept failing (left to gc)


DELETE_BATCH = 1000  # the S3 DeleteObjects limit
SharedKey = tuple[tuple[str, Any], ...]
_SHARED: dict[SharedKey, list[Any]] = {}  # config identity -> [store, refcount]
_SHARED_LOCK = threading.Lock()
_KEY_SALT = secrets.token_bytes(16)  # per process: a shared key is no stable hash of a secret


def _shared_key(config: ECS3Config) -> SharedKey:
    """The identity of a configuration: every field, each secret as a keyed digest.

    Two configs that differ only in credentials must get two clients (one client would
    sign both with the first one's keys), yet the key must not hold a secret in clear
    where a repr or a log could show it.
    """

    def ident(value: Any) -> Any:
        if isinstance(value, Secret):
            return "hmac-sha256:" + hmac.new(_KEY_SALT, value.reveal().encode(), hashlib.sha256).hexdigest()
        try:
            hash(value)
        except TypeError:
            return repr(value)
        return value

    return tuple((f.name, ident(getattr(config, f.name))) for f in dataclasses.fields(config))


class S3Store:
    """Blob store for one bucket; thread-safe, non-blocking, shared loop.

    Construction does no I/O: the client is created on first use on the loop.
    """

    def __init__(self, config: ECS3Config, *, loop: BackgroundLoop | None = None) -> None:
        self.config = config
        self.bucket = config.bucket
        self._bg = loop or shared_loop()
        self._client: Any = None
        self._wire: DirectWire | None = None
        self._client_lock: asyncio.Lock | None = None
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._sem: Slots | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._client_gone = False
        self._shared_key: SharedKey | None = None
        self.stats = StoreStats()
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s)

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, endpoint_url={self.config.endpoint_url!r})"

    @classmethod
    def shared(cls, config: ECS3Config) -> S3Store:
        """The process-wide store for this configuration, reference-counted.

        The scheduler-role and worker-role connectors of one process then share one
        connection pool, one concurrency bound and one circuit breaker (so an outage
        is logged once per process, not once per connector). Release with
        :meth:`close`.
        """
        key = _shared_key(config)
        with _SHARED_LOCK:
            entry = _SHARED.get(key)
            if entry is None or entry[0]._closed or entry[0]._bg is not shared_loop():
                entry = _SHARED[key] = [cls(config), 0]
            entry[1] += 1
            store = entry[0]
            store._shared_key = key
            return store

    # ------------------------------------------------------------------ plumbing
    @property
    def background(self) -> BackgroundLoop:
        return self._bg

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        """Run ``coro`` on the store's loop; returns a ``concurrent.futures.Future``.

        Tracked, so :meth:`close` can drain or cancel it.
        """
        if self._closed:
            coro.close()
            raise StoreClosed("submit", "", "store is closed")
        return self._bg.submit(self._tracked(coro))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Block until ``coro`` is done. For CLIs, tests and shutdown, never the engine."""
        return self.submit(coro).result(timeout)

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._tasks.discard(task)
            else:
                task.add_done_callback(self._tasks.discard)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` detached, on the loop (call it there), tracked so that
        :meth:`close` drains it: work no caller waits for, such as an abort."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def warm_up(self, key: str | None = None) -> None:
        """Create the client now, and with ``key`` open a pooled connection by a HEAD of
        it, in the background: otherwise the first upload or lookup after start pays for
        the credential chain, the client and a TCP (and TLS) handshake. Failures are left
        to the start-up checks and the first real request to report."""

        async def warm() -> None:
            try:
                await self._get_client()
                if key is not None:
                    await self.head_async(key)
            except Exception as exc:  # noqa: BLE001 - best effort; real requests report
                logger.debug("ec-s3: warming up the S3 client failed: %s", exc)

        with contextlib.suppress(Exception):
            self.submit(warm())

    async def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        if self._client_gone:
            # Work submitted before close() may still run while close() drains it;
            # only after the drain is the client gone for good.
            raise StoreClosed("connect", "", "store is closed")
        if self._client_lock is None:
            self._client_lock = asyncio.Lock()
        async with self._client_lock:
            if self._client is None:
                stack = contextlib.AsyncExitStack()
                try:
                    # Resolves the credential chain (profile, SSO, instance role) when
                    # the config names no keys: that can fail, and must fail typed.
                    settings = resolve_endpoint(self.config)  # one region and CA for both paths
                    client = await open_client(self.config, stack, settings)
                    if self.config.data_path == "direct":
                        # Its own pool beside the client's, which keeps the rare rest; closed first.
                        wire = DirectWire(self.config, client, settings.trust)
                        stack.push_async_callback(wire.close)
                        self._wire = wire
                except Exception as exc:  # noqa: BLE001 - mapped below
                    await stack.aclose()
                    error = to_store_error("connect", "", exc)
                    if error is None:
                        error = StoreConfigError("connect", "", f"cannot create the S3 client: {type(exc).__name__}: {exc}")
                        error.__cause__ = exc
                    raise error from exc
                self._exit_stack = stack
                # Requests queue here, not in aiohttp's pool: a pool wait is bounded
                # (connection.py) and must only ever mean a held-up connection.
                self._sem = Slots(min(self.config.max_concurrency, self.config.max_pool_connections),
                                  self.config.request_timeout_s)
                self._client = client  # last: its being set means the store is ready
        return self._client

    async def _call(self, op: str, key: str, fn: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
        """Run one S3 request with the retry budget, the concurrency bound and the breaker."""
        ticket = self.breaker.allow()
        if ticket is None:
            self.stats.short_circuited += 1
            raise CircuitOpen(op, key, "the store failed repeatedly, not trying")
        try:
            return await self._attempts(op, key, fn, ticket)
        finally:
            self.breaker.release(ticket)  # however it ended, a probe must not stay pending

    async def _attempts(self, op: str, key: str, fn: Callable[[Any], Coroutine[Any, Any, T]], ticket: int) -> T:
        cfg = self.config
        client = await self._get_client()
        assert self._sem is not None
        for attempt in range(1, cfg.max_attempts + 1):
            self.stats.requests += 1
            caller_error: Exception | None = None
            try:
                async with self._sem.hold(op, key):
                    result = await fn(client)
                self.breaker.success()
                return result
            except StoreBusy:
                raise  # local saturation: a retry would queue again; not the store's fault
            except _CallerError as wrapped:
                caller_error = wrapped.error
            except Exception as exc:  # noqa: BLE001 - every transport failure becomes a StoreError
                mapped = to_store_error(op, key, exc)
                if mapped is None:
                    raise  # not a store failure: a bug, shown as it is
                error = mapped
            if caller_error is not None:
                raise caller_error  # outside the except block: its chain stays the caller's
            if not error.transient or attempt == cfg.max_attempts:
                self.stats.failures += isinstance(error, (StoreUnavailable, AccessDenied))
                if error.transient:
                    self.breaker.failure(error.reason, ticket)
                elif error.status is not None:
                    self.breaker.success()  # the store answered: it is up
                raise error
            self.stats.retries += 1
            delay = random.uniform(0, min(cfg.retry_max_delay_s, cfg.retry_base_delay_s * 2 ** (attempt - 1)))
            logger.debug("ec-s3: retrying %s %s in %.3fs after %s", op, key, delay, error.reason)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ operations
    async def head_async(self, key: str) -> ObjectInfo | None:
        """Size and metadata of ``key``, or None if it does not exist."""

        async def _head(client: Any) -> ObjectInfo:
            if self._wire is not None:
                return _info_from_headers(key, await self._wire.head(key))
            resp = await client.head_object(Bucket=self.bucket, Key=key)
            return _info(key, resp)

        try:
            return await self._call("HEAD", key, _head)
        except ObjectNotFound:
            return None

    async def put_async(
        self,
        key: str,
        body: Body,
        *,
        metadata: dict[str, str] | None = None,
    ) -> PutOutcome:
        """Store an immutable blob; a 412 from the conditional put means it exists."""
        view = body if isinstance(body, BufferChain) else BufferChain([body])
        if len(view) > self.config.max_blob_bytes:
            raise StoreRequestError("PUT", key, f"{len(view)} bytes exceeds max_blob_bytes")
        crc: int | None = None
        if self.config.checksum_algorithm != "none":
            crc = await crc32_of(view)
            metadata = {**(metadata or {}), CRC_METADATA_KEY: f"{crc:08x}"}
        if len(view) >= self.config.multipart_threshold_bytes:
            # One HEAD is cheap next to uploading every part only to meet a 412.
            if await self.head_async(key) is not None:
                return PutOutcome.ALREADY_EXISTS
            created = await put_multipart(self, key, view, metadata or {})
            outcome = PutOutcome.CREATED if created else PutOutcome.ALREADY_EXISTS
        else:
            outcome = await self._put_single(key, view, metadata or {}, crc)
        if outcome is PutOutcome.CREATED:
            self.stats.bytes_uploaded += len(view)
        return outcome

    async def _put_single(self, key: str, view: BufferChain, metadata: dict[str, str], crc: int | None) -> PutOutcome:
        extra = self._checksum_args()
        direct = await self._direct_checksum(view, crc)

        async def _put(client: Any) -> PutOutcome:
            if self._wire is not None and direct is not None:
                headers = {
                    "If-None-Match": "*", "Content-Type": "application/octet-stream",
                    **{f"x-amz-meta-{k}": v for k, v in metadata.items()}, **direct,
                }
                await self._wire.put("PUT", key, view, headers)
                return PutOutcome.CREATED
            await client.put_object(
                Bucket=self.bucket, Key=key, Body=ChainReader(view), ContentLength=len(view),
                IfNoneMatch="*", Metadata=metadata, ContentType="application/octet-stream", **extra,
            )
            return PutOutcome.CREATED

        return await self._conditional("PUT", key, _put)

    async def _conditional(self, op: str, key: str, fn: Callable[[Any], Coroutine[Any, Any, PutOutcome]]) -> PutOutcome:
        try:
            return await self._call(op, key, fn)
        except StoreRequestError as exc:
            if exc.status == 412:
                return PutOutcome.ALREADY_EXISTS
            raise

    async def get_async(self, key: str, *, allocate: Allocator | None = None) -> memoryview:
        """Fetch a whole object into one writable buffer, without a HEAD.

        The first request asks for the first part (``Range: bytes=0-<part-1>``); its
        ``Content-Range`` gives the object's size, so a blob up to one part costs one
        round trip and a larger one fetches its remaining parts in parallel, each with
        ``If-Match`` of the first answer's ETag: an object replaced between two ranges
        is never a blend. Then the whole GET restarts once, into the same buffer; a
        second change (or another size) is :class:`ObjectChanged`.
        ``allocate(size)`` says where the bytes go (e.g. a shared-memory staging slot),
        so the body is copied once, from the socket to its final place.
        """
        def alloc(nbytes: int) -> memoryview:
            if allocate is None:
                return memoryview(bytearray(nbytes))
            try:
                return allocate(nbytes)
            except Exception as exc:  # noqa: BLE001 - the caller's, re-raised unchanged by _call
                raise _CallerError(exc) from exc

        holder: list[memoryview] = []
        for attempt in (1, 2):
            try:
                out, stored_crc = await self._get_whole(key, alloc, holder)
                break
            except ObjectChanged:
                if attempt == 2:
                    raise
        self.stats.bytes_downloaded += len(out)
        if self.config.checksum_algorithm != "none" and stored_crc:
            actual = f"{await crc32_of(out):08x}"
            if actual != stored_crc:
                self.stats.integrity_failures += 1
                raise IntegrityError("GET", key, f"CRC32 {actual} != stored {stored_crc}")
        return out

    async def _get_whole(
        self, key: str, alloc: Callable[[int], memoryview], holder: list[memoryview]
    ) -> tuple[memoryview, str]:
        """One pass of :meth:`get_async`: the object in ``holder[0]`` (allocated on the
        first answer) and the CRC its writer stored."""
        part = self.config.multipart_part_bytes
        # A blob is a whole number of MiB of tensor plus a small header: asking for one
        # part plus a header's worth keeps an N-part blob from needing one more request.
        last = part + MAX_HEADER_BYTES - 1
        seen: dict[str, str] = {}

        def _place(length: int, total: int) -> memoryview:
            if total > self.config.max_blob_bytes:
                raise StoreRequestError("GET", key, f"{total} bytes exceeds max_blob_bytes")
            if not holder:
                holder.append(alloc(total))
            if len(holder[0]) != total:
                raise ObjectChanged("GET", key, f"object is {total} bytes now, was {len(holder[0])}")
            return holder[0][:length]

        async def _first(client: Any) -> int:
            async with self._open_range(client, key, 0, last) as answer:
                span = check_answer(answer.status, answer.headers, 0, last, key)
                seen.update(crc=answer.headers.get(_CRC_HEADER, ""), etag=answer.headers.get("ETag", ""))
                if span.length is None:  # a 200 of unknown length (chunked): the whole object
                    data = await answer.read_to_end(self.config.max_blob_bytes)
                    _place(len(data), len(data))[:] = data
                    return len(data)
                await answer.read_into(_place(span.length, span.total or span.length))
                return span.length

        first = await self._call("GET", key, _first)
        out = holder[0]
        if first < len(out):
            etag = seen["etag"] or None
            await _all_or_none(
                [self._get_range(key, out, start, min(start + part, len(out)), etag) for start in range(first, len(out), part)]
            )
        return out, seen["crc"]

    async def _get_range(self, key: str, out: memoryview, start: int, end: int, etag: str | None) -> None:
        async def _get(client: Any) -> None:
            async with self._open_range(client, key, start, end - 1, etag) as answer:
                span = check_answer(answer.status, answer.headers, start, end - 1, key)
                if span.total != len(out):
                    raise ObjectChanged("GET", key, f"object is {span.total} bytes now, was {len(out)}")
                await answer.read_into(out[start:end])

        try:
            await self._call("GET", key, _get)
        except StoreRequestError as exc:
            if exc.status != 412:
                raise
            raise ObjectChanged("GET", key, "replaced between two ranges of one GET", status=412, code=exc.code) from exc

    @contextlib.asynccontextmanager
    async def _open_range(
        self, client: Any, key: str, first: int, last: int, if_match: str | None = None
    ) -> AsyncIterator[GetAnswer]:
        """``Range: bytes=first-last`` of ``key`` on this store's data path, its body
        unread; released on every way out."""
        if self._wire is not None:
            async with self._wire.get(key, first, last, if_match) as answer:
                yield answer
            return
        condition = {"IfMatch": if_match} if if_match else {}
        resp = await client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={first}-{last}", **condition)
        with _closing(resp["Body"]) as body:
            yield BotocoreAnswer(resp, body, key)

    async def delete_async(self, key: str) -> None:
        async def _delete(client: Any) -> None:
            await client.delete_object(Bucket=self.bucket, Key=key)

        await self._call("DELETE", key, _delete)

    async def delete_many_async(self, keys: Iterable[str]) -> int:
        """Delete keys in batches of :data:`DELETE_BATCH`; returns how many were deleted."""
        pending, deleted = list(keys), 0
        for i in range(0, len(pending), DELETE_BATCH):
            batch = [{"Key": k} for k in pending[i : i + DELETE_BATCH]]

            async def _delete(client: Any, batch: list[dict[str, str]] = batch) -> int:
                resp = await client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                errors = resp.get("Errors") or []
                if errors:
                    raise StoreRequestError("DeleteObjects", errors[0].get("Key", ""), errors[0].get("Message", ""))
                return len(batch)

            deleted += await self._call("DeleteObjects", batch[0]["Key"], _delete)
        return deleted

    async def list_async(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Every object under ``prefix``, page by page."""
        token: str | None = None
        while True:
            async def _list(client: Any, token: str | None = token) -> dict[str, Any]:
                kwargs = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": 1000}
                if token:
                    kwargs["ContinuationToken"] = token
                return await client.list_objects_v2(**kwargs)

            page = await self._call("LIST", prefix, _list)
            for item in page.get("Contents", []):
                modified = item.get("LastModified")
                yield ObjectInfo(
                    key=item["Key"], size=int(item.get("Size", 0)), etag=item.get("ETag", "").strip('"'),
                    last_modified=modified.timestamp() if modified else 0.0,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    async def create_bucket_async(self) -> None:
        """Create the bucket if it does not exist (tests, demo, CLI)."""

        async def _create(client: Any) -> None:
            await client.create_bucket(Bucket=self.bucket)

        try:
            await self._call("CreateBucket", self.bucket, _create)
        except StoreRequestError as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Let pending requests finish for up to ``timeout`` seconds, cancel the rest,
        and close the client. Idempotent; callable from any thread but the loop's."""
        if self._closed:
            return
        if self._shared_key is not None:
            with _SHARED_LOCK:
                entry = _SHARED.get(self._shared_key)
                if entry is not None and entry[0] is self:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return  # other users in this process still need it
                    del _SHARED[self._shared_key]
        self._closed = True
        if not self._bg.is_running:
            return
        try:
            self._bg.run(self._aclose(timeout), timeout + 5.0)
        except Exception as exc:  # noqa: BLE001 - closing must not raise into vLLM's shutdown
            logger.warning("ec-s3: closing the S3 client failed: %s", exc)

    async def _aclose(self, timeout: float) -> None:
        # Until none is left: work drained or cancelled here may spawn more (an abort).
        deadline = time.monotonic() + timeout
        while pending := [t for t in self._tasks if not t.done()]:
            _, still = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            for task in still:
                task.cancel()
            if still:
                logger.warning("ec-s3: cancelled %d S3 operations still pending after %.1fs", len(still), timeout)
                await asyncio.gather(*still, return_exceptions=True)
        self._client_gone = True
        self._wire = None  # closed by the exit stack, before the client
        if self._exit_stack is not None:
            await self._exit_stack.aclose()
            self._client = None

    # ------------------------------------------------------------------ helpers
    def _checksum_args(self) -> dict[str, str]:
        algo = self.config.checksum_algorithm
        return {} if algo == "none" else {"ChecksumAlgorithm": algo}

    async def _direct_checksum(self, body: BufferChain, crc: int | None) -> dict[str, str] | None:
        """The checksum headers of ``body`` for the direct path, or None when that
        request must go through botocore (``CRC32C`` needs awscrt, which botocore
        drives). CRC32 reuses the CRC the store computed for its metadata."""
        algo = self.config.checksum_algorithm
        if self._wire is None or algo == "none":
            return {}
        if algo == "CRC32":
            value = crc if crc is not None else await crc32_of(body)
            return {_CHECKSUM_HEADERS["ChecksumCRC32"]: base64.b64encode(value.to_bytes(4, "big")).decode()}
        if algo == "SHA256":
            return {_CHECKSUM_HEADERS["ChecksumSHA256"]: base64.b64encode(await sha256_of(body)).decode()}
        return None


@contextlib.contextmanager
def _closing(body: Any) -> Iterator[Any]:
    """Close a response body on every way out (errors of ours or the caller's allocator,
    cancellation). An unclosed body pins its pooled connection: once all are pinned,
    every later request of the process waits for one. Closing a body read to its end
    is a no-op (aiohttp has already returned the connection to the pool)."""
    try:
        yield body
    finally:
        body.close()




_CRC_HEADER = f"x-amz-meta-{CRC_METADATA_KEY}"


def _info_from_headers(key: str, headers: Mapping[str, str]) -> ObjectInfo:
    """A HEAD answer's headers as botocore's ``head_object`` would have parsed them."""
    modified = headers.get("Last-Modified")
    when = email.utils.parsedate_to_datetime(modified).timestamp() if modified else time.time()
    prefix = "x-amz-meta-"
    return ObjectInfo(
        key=key,
        size=int(headers.get("Content-Length", "0") or 0),
        etag=headers.get("ETag", "").strip('"'),
        last_modified=when,
        metadata={k.lower()[len(prefix):]: v for k, v in headers.items() if k.lower().startswith(prefix)},
    )


def _info(key: str, resp: dict[str, Any]) -> ObjectInfo:
    modified = resp.get("LastModified")
    return ObjectInfo(
        key=key,
        size=int(resp.get("ContentLength", 0)),
        etag=str(resp.get("ETag", "")).strip('"'),
        last_modified=modified.timestamp() if modified else time.time(),
        metadata=dict(resp.get("Metadata") or {}),
    )
