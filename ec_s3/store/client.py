"""The S3 store: blob operations on one bucket, with retries and a concurrency bound.

Owns :class:`S3Store`, whose operations run on the background loop of :mod:`ec_s3.loop`, the
retry loop (back-off with full jitter, on transient failures only, ``Retry-After`` heeded), the
concurrency bound, :class:`StoreStats` and the process-wide cache of shared stores. Does not own
one attempt of a request (:mod:`.transport`), the errors and their mapping (:mod:`.errors`), the
breaker, bodies, a blob's PUT (:mod:`.upload`), multipart uploads (:mod:`.multipart`) or a GET's
ranges (:mod:`.download`); their names are re-exported here for importers of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.loop import BackgroundLoop, shared_loop
from ec_s3.store.body import Body, BufferChain
from ec_s3.store.breaker import CircuitBreaker
from ec_s3.store.errors import (
    AccessDenied,
    BucketNotFound,
    CircuitOpen,
    CredentialsTimeout,
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
from ec_s3.store.diagnose import credential_source
from ec_s3.store.download import CRC_METADATA_KEY, Download, open_download
from ec_s3.store.error_map import from_delete_error, to_store_error
from ec_s3.store.hedge import Hedging
from ec_s3.store.settings import SharedKey, StoreConfig, shared_key
from ec_s3.store.permits import Lease, RequestPermits
from ec_s3.store.transport import ObjectInfo, Transport, open_transport
from ec_s3.store.upload import WRITE_TOKEN_METADATA_KEY, put_blob

__all__ = [
    "AccessDenied",
    "Body",
    "BucketNotFound",
    "BufferChain",
    "CRC_METADATA_KEY",
    "CircuitBreaker",
    "CircuitOpen",
    "DELETE_BATCH",
    "Download",
    "IntegrityError",
    "NoCredentials",
    "ObjectChanged",
    "ObjectInfo",
    "ObjectNotFound",
    "PutOutcome",
    "S3Store",
    "StoreClosed",
    "StoreConfig",
    "StoreConfigError",
    "StoreError",
    "StoreRequestError",
    "StoreStats",
    "StoreTimeout",
    "StoreUnavailable",
    "StoreUnreachable",
    "TLSError",
    "WRITE_TOKEN_METADATA_KEY",
]

T = TypeVar("T")
Allocator = Callable[[int], memoryview]


@dataclasses.dataclass
class StoreStats:
    """Counters since start; updated on the loop thread only, read from anywhere.

    The fields are running totals (tests and the CLI read them). :meth:`take_delta` hands
    each increment to exactly one caller, whichever asks first: the scheduler-role and
    worker-role connectors of one process share a store (:meth:`S3Store.shared`) and
    each folds what it takes into its own counters
    (:meth:`ec_s3.transfer.counters.Counters.pull`), so nothing is counted twice and
    nothing is left unread in a worker process of its own.
    """

    requests: int = 0
    retries: int = 0
    failures: int = 0
    short_circuited: int = 0
    integrity_failures: int = 0
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    abandoned_uploads: int = 0  # multipart uploads whose aborts kept failing (left to gc)
    # Writes whose answer was lost and whose resend met the write itself (a 412 on an
    # object carrying this write's token): counted as created (put_async).
    lost_answer_writes: int = 0
    hedges: int = 0  # GET ranges asked again for running past their expected time (hedge.py)
    hedges_won: int = 0
    _taken: dict[str, int] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _take_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def take_delta(self) -> dict[str, float]:
        """Each counter's increment since the last call, as ``store_<field>`` (only those
        that moved). Thread-safe: two callers never both get one increment."""
        with self._take_lock:
            delta: dict[str, float] = {}
            for field in _STAT_FIELDS:
                total = getattr(self, field)  # one read: a later increment waits for the next call
                moved = total - self._taken.get(field, 0)
                if moved:
                    delta[f"store_{field}"] = float(moved)
                    self._taken[field] = total
            return delta


_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(StoreStats) if not f.name.startswith("_"))


DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_SHARED: dict[SharedKey, list[Any]] = {}  # store config identity -> [store, refcount]
_SHARED_LOCK = threading.Lock()


class S3Store:
    """Blob store for one bucket; thread-safe, non-blocking, shared loop.

    Construction does no I/O: the client is created on first use on the loop.
    """

    def __init__(self, config: ECS3Config | StoreConfig, *, loop: BackgroundLoop | None = None) -> None:
        self.config = config = StoreConfig.of(config)
        self.bucket = config.bucket
        self._bg = loop or shared_loop()
        self._transport: Transport | None = None
        self._connecting: asyncio.Future[Transport] | None = None
        self._connect_failure: tuple[StoreError, float] | None = None  # and until when it stands
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._permits: RequestPermits | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closed = False
        self._client_gone = False
        self._shared_key: SharedKey | None = None
        self.stats = StoreStats()
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s)
        self.hedging = Hedging(config.hedge_after_factor, config.max_hedges_in_flight)

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, endpoint_url={self.config.endpoint_url!r})"

    @classmethod
    def shared(cls, config: ECS3Config | StoreConfig) -> S3Store:
        """The process-wide store for this configuration, reference-counted.

        The scheduler-role and worker-role connectors of one process then share one
        connection pool, one concurrency bound and one circuit breaker (so an outage
        is logged once per process, not once per connector), whatever keys outside the
        store's own they differ in. Release with :meth:`close`.
        """
        config = StoreConfig.of(config)
        key = shared_key(config)
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
        """The aiobotocore client (for the CLI's probes and tests)."""
        return (await self._get_transport()).client

    async def _get_transport(self) -> Transport:
        """The store's transport, created on first use by one connect task that every
        request waiting for it shares (none of them runs it in its own task, so one
        caller's cancellation does not end it for the others). Its failure is
        remembered for ``breaker_cooldown_s``: until then requests fail at once with it,
        instead of each running the credential chain again in turn."""
        if self._transport is not None:
            return self._transport
        if self._client_gone:
            # Work submitted before close() may still run while close() drains it;
            # only after the drain is the client gone for good.
            raise StoreClosed("connect", "", "store is closed")
        if self._connect_failure is not None:
            error, until = self._connect_failure
            if time.monotonic() < until:
                raise copy.copy(error)  # a copy per raise: each gets its own traceback
            self._connect_failure = None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._tasks.add(self._connecting)  # close() drains it
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, task: asyncio.Future[Transport]) -> None:
        self._tasks.discard(task)
        self._connecting = None
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have given up on it

    async def _connect(self) -> Transport:
        stack = contextlib.AsyncExitStack()
        try:
            # Resolves the credential chain (profile, SSO, instance role) when the config
            # names no keys: that can fail or hang, and must fail typed, in bounded time.
            async with asyncio.timeout(self.config.request_timeout_s):
                transport = await open_transport(self.config, stack)
        except BaseException as exc:
            await stack.aclose()  # a credential process still running is ended with its transport
            if not isinstance(exc, Exception):
                raise  # cancelled (close() gave up on it): nothing to remember
            error = self._connect_error(exc)
            self._connect_failure = (error, time.monotonic() + self.config.breaker_cooldown_s)
            raise error from exc
        self._exit_stack = stack
        # Requests queue here, not in aiohttp's pool: a pool wait is bounded
        # (connection.py) and must only ever mean a held-up connection.
        self._permits = RequestPermits(min(self.config.max_concurrency, self.config.max_pool_connections),
                                       self.config.request_timeout_s)
        self._transport = transport  # last: its being set means the store is ready
        return transport

    def _connect_error(self, exc: Exception) -> StoreError:
        """The typed error of a failed client creation, naming the credential source."""
        source = credential_source(self.config)  # type: ignore[arg-type] - reads the keys it shares
        if isinstance(exc, TimeoutError):
            return CredentialsTimeout("connect", "", f"creating the S3 client took over request_timeout_s="
                                      f"{self.config.request_timeout_s:g}s resolving credentials from {source}")
        error = to_store_error("connect", "", exc)
        if error is None:
            error = StoreConfigError("connect", "", f"cannot create the S3 client: {type(exc).__name__}: {exc}")
        elif isinstance(error, NoCredentials):
            error = type(error)("connect", "", f"{error.message} (credentials from {source})")
        error.__cause__ = exc
        return error

    async def _call(
        self, op: str, key: str, fn: Callable[[Transport], Coroutine[Any, Any, T]], *, permit: bool = True,
        spent: int = 0,
    ) -> T:
        """Run one S3 request, ``fn`` one attempt of it on the store's transport, with
        its ``max_attempts`` (less ``spent`` attempts made elsewhere), the concurrency bound
        and the breaker. With ``permit=False``, ``fn`` takes its request permit itself
        (:meth:`_lease`), to keep it past the call."""
        ticket = self.breaker.allow()
        if ticket is None:
            self.stats.short_circuited += 1
            raise CircuitOpen(op, key, "the store failed repeatedly, not trying")
        try:
            return await self._attempts(op, key, fn, ticket, permit, spent)
        finally:
            self.breaker.release(ticket)  # however it ended, a probe must not stay pending

    async def _attempts(
        self, op: str, key: str, fn: Callable[[Transport], Coroutine[Any, Any, T]], ticket: int, permit: bool,
        spent: int,
    ) -> T:
        cfg = self.config
        transport = await self._get_transport()
        for attempt in range(1 + min(spent, cfg.max_attempts - 1), cfg.max_attempts + 1):
            self.stats.requests += 1
            try:
                async with self._permit(op, key) if permit else contextlib.nullcontext():
                    result = await fn(transport)
                self.breaker.success()
                return result
            except StoreBusy:
                raise  # local saturation: a retry would queue again; not the store's fault
            except Exception as exc:  # noqa: BLE001 - every transport failure becomes a StoreError
                mapped = to_store_error(op, key, exc)
                if mapped is None:
                    raise  # not a store failure: a bug, shown as it is
                error = mapped
            delay = self._retry_delay(attempt, error) if error.transient and attempt < cfg.max_attempts else None
            if delay is None:  # not retried: not transient, the last attempt, or asked to wait too long
                self.stats.failures += isinstance(error, (StoreUnavailable, AccessDenied))
                if error.transient:
                    self.breaker.failure(error.reason, ticket)
                elif error.status is not None:
                    self.breaker.success()  # the store answered: it is up
                raise error
            self.stats.retries += 1
            logger.debug("ec-s3: retrying %s %s in %.3fs after %s", op, key, delay, error.reason)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _retry_delay(self, attempt: int, error: StoreError) -> float | None:
        """The wait before attempt ``attempt + 1``: the back-off (full jitter), or longer
        when the answer's ``Retry-After`` asked for it; None (do not retry) when it asked
        for more than ``request_timeout_s``: no sooner than asked, never past the deadline."""
        cfg = self.config
        delay = random.uniform(0, min(cfg.retry_max_delay_s, cfg.retry_base_delay_s * 2 ** (attempt - 1)))
        if error.retry_after_s is None:
            return delay
        if error.retry_after_s > cfg.request_timeout_s:
            return None
        return max(delay, error.retry_after_s)

    def _permit(self, op: str, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        """One request permit, for one attempt (the store is connected: :meth:`_call`)."""
        assert self._permits is not None
        return self._permits.hold(op, key)

    def _lease(self, op: str, key: str) -> contextlib.AbstractAsyncContextManager[Lease]:
        """One request permit whose attempt may run in several tasks (:class:`~.permits.Lease`)."""
        assert self._permits is not None
        return self._permits.lease(op, key)

    # ------------------------------------------------------------------ operations
    async def head_async(self, key: str) -> ObjectInfo | None:
        """Size and metadata of ``key``, or None if it does not exist."""
        try:
            return await self._call("HEAD", key, lambda t: t.head(key))
        except ObjectNotFound:
            return None

    async def put_async(self, key: str, body: Body, *, metadata: dict[str, str] | None = None) -> PutOutcome:
        """Store an immutable blob; a 412 from the conditional put means it exists (:mod:`.upload`)."""
        return await put_blob(self, key, body, metadata)

    def open_async(self, key: str, expected_size: int | None = None) -> contextlib.AbstractAsyncContextManager[Download]:
        """``async with store.open_async(key) as d``: a GET's first answer, ``d.size``
        known, its body unread; place the bytes, then ``await d.read_into(buffer)``
        (:mod:`.download`). Without a HEAD; released on every way out. With
        ``expected_size`` (exact, or an upper bound), every range is asked at once."""
        return open_download(self, key, expected_size)

    async def get_async(self, key: str, *, allocate: Allocator | None = None,
                        expected_size: int | None = None) -> memoryview:
        """The whole object, in ``allocate(size)`` (run once, between the two phases of
        :meth:`open_async`, outside any retry) or a new buffer."""
        async with self.open_async(key, expected_size) as download:
            out = allocate(download.size) if allocate is not None else memoryview(bytearray(download.size))
            await download.read_into(out)
        return out

    async def delete_async(self, key: str) -> None:
        await self._call("DELETE", key, lambda t: t.client.delete_object(Bucket=self.bucket, Key=key))

    async def delete_many_async(self, keys: Iterable[str]) -> int:
        """Delete keys in batches of :data:`DELETE_BATCH`; returns how many were deleted."""
        pending, deleted = list(keys), 0
        for i in range(0, len(pending), DELETE_BATCH):
            batch = [{"Key": k} for k in pending[i : i + DELETE_BATCH]]

            async def _delete(t: Transport, batch: list[dict[str, str]] = batch) -> int:
                resp = await t.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                errors = resp.get("Errors") or []
                if errors:
                    raise from_delete_error(errors[0])
                return len(batch)

            deleted += await self._call("DeleteObjects", batch[0]["Key"], _delete)
        return deleted

    async def list_async(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        """Every object under ``prefix``, page by page."""
        token: str | None = None
        while True:
            async def _list(t: Transport, token: str | None = token) -> dict[str, Any]:
                kwargs = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": 1000}
                if token:
                    kwargs["ContinuationToken"] = token
                return await t.client.list_objects_v2(**kwargs)

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

    async def create_bucket_async(self, region: str | None = None, *, taken_is_error: bool = False) -> None:
        """Create the bucket if it does not exist (tests, demo, ``check --create-bucket``).
        ``region``: AWS S3 creates a bucket outside us-east-1 only when told where.
        ``taken_is_error``: BucketAlreadyExists (on AWS: another account's bucket) raises."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        exists = ("BucketAlreadyOwnedByYou",) if taken_is_error else ("BucketAlreadyOwnedByYou", "BucketAlreadyExists")
        try:
            await self._call("CreateBucket", self.bucket, lambda t: t.client.create_bucket(**kwargs))
        except StoreRequestError as exc:
            if exc.code not in exists:
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
        if self._exit_stack is not None:
            await self._exit_stack.aclose()
            self._transport = None

