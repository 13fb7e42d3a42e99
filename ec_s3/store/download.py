"""A whole-object GET in two phases: :func:`open_download` learns the size, the caller
places the bytes, :meth:`Download.read_into` fills them.

Owns the ranges of one GET (the first answer held open until read, the others in parallel,
each ``If-Match`` its ETag), their order, the one restart (then :class:`~.errors.ObjectChanged`)
and the CRC check. Does not own the retry loop, the breaker or the request permits
(:class:`ec_s3.store.client.S3Store`, reached through :class:`DownloadingStore`), nor how one
range travels (:mod:`.transport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from ec_s3.blob.format import MAX_HEADER_BYTES
from ec_s3.store.body import crc32_of
from ec_s3.store.breaker import CircuitBreaker
from ec_s3.store.error_map import to_store_error
from ec_s3.store.errors import IntegrityError, ObjectChanged, StoreRequestError
from ec_s3.store.hedge import Hedging, Stopwatch, race
from ec_s3.store.permits import Lease, RequestPermits
from ec_s3.store.ranges import check_answer
from ec_s3.store.settings import StoreConfig
from ec_s3.store.tasks import all_or_none
from ec_s3.store.transport import Transport
from ec_s3.store.wire import GetAnswer

__all__ = ["CRC_METADATA_KEY", "Download", "DownloadingStore", "get_whole", "open_download", "plan_ranges", "strong_etag"]

T = TypeVar("T")
CRC_METADATA_KEY = "ec-s3-crc32"
_CRC_HEADER = f"x-amz-meta-{CRC_METADATA_KEY}"


class DownloadingStore(Protocol):
    """What this module needs of :class:`ec_s3.store.client.S3Store`."""

    config: StoreConfig
    stats: Any
    breaker: CircuitBreaker
    hedging: Hedging
    _permits: RequestPermits | None

    async def _get_transport(self) -> Transport: ...

    async def _call(
        self, op: str, key: str, fn: Callable[[Transport], Awaitable[T]], *, permit: bool = True, spent: int = 0
    ) -> T: ...

    def _lease(self, op: str, key: str) -> contextlib.AbstractAsyncContextManager[Lease]: ...


@dataclasses.dataclass
class _First:
    """The first answer, its body unread (or, for a 200 of unknown length, read into
    ``data``); ``scope`` holds its request permit (``lease``) and connection."""

    scope: contextlib.AsyncExitStack
    lease: Lease
    answer: GetAnswer
    length: int
    size: int
    etag: str
    crc: str
    first_byte_s: float
    data: bytes | None = None


def plan_ranges(start: int, end: int, range_bytes: int, most: int, slack: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` in ranges of about ``range_bytes`` (up to ``slack`` more: a blob's
    header), equal so that they end together, at most ``most`` of them, one at least."""
    n = max(1, min(most, -(-(end - start - slack) // range_bytes)))
    bounds = [start + (end - start) * i // n for i in range(n + 1)]
    return list(zip(bounds, bounds[1:]))


async def _open_first(store: DownloadingStore, key: str, last: int) -> _First:
    """The answer to ``Range: bytes=0-last``, its body unread, its permit held. Hedged on
    its head alone: its body is read only once the caller has placed it."""

    async def _open(t: Transport, watch: Stopwatch) -> _First:
        async with contextlib.AsyncExitStack() as scope:
            lease = await scope.enter_async_context(store._lease("GET", key))
            watch.start()
            async with lease.bounded():  # this task's part of the attempt
                answer = await scope.enter_async_context(t.open_range(key, 0, last))
                span = check_answer(answer.status, answer.headers, 0, last, key)
                first = _First(scope, lease, answer, span.length or 0, span.total or span.length or 0,
                               answer.headers.get("ETag", ""), answer.headers.get(_CRC_HEADER, ""), watch.elapsed())
                if span.length is None:  # a 200 of unknown length (chunked): the whole object
                    first.data = await answer.read_to_end(store.config.max_blob_bytes)
                    first.length = first.size = len(first.data)
            if first.size > store.config.max_blob_bytes:
                raise StoreRequestError("GET", key, f"{first.size} bytes exceeds max_blob_bytes")
            first.scope = scope.pop_all()  # held until read_into (or close) releases it
            return first

    async def _release(first: _First) -> None:
        await first.scope.aclose()

    return await race(store, 0, lambda w: store._call("GET", key, lambda t: _open(t, w), permit=False),
                      lambda w: _hedge(store, key, lambda t: _open(t, w), permit=False), _release)


async def _hedge(store: DownloadingStore, key: str, fn: Callable[[Transport], Awaitable[T]], *, permit: bool) -> T:
    """A hedge's one attempt: not retried (its primary is), not the breaker's (a hedge
    cancelled is no failure of the store), on a connection of its own (the primary's is
    busy, never shared)."""
    transport = await store._get_transport()
    store.stats.requests += 1
    if not permit:
        return await fn(transport)
    async with store._lease("GET", key) as lease, lease.bounded():
        return await fn(transport)


class Download:
    """One object being fetched: :attr:`size` known, the bytes not yet read. Read it
    with :meth:`read_into`, once; :meth:`aclose` (done by ``S3Store.open_async``)
    releases what is still held on every way out. The time between the two counts
    against the attempts in flight (``request_timeout_s``): past it, a range is
    asked again (a retry), and nothing of the caller's is cancelled.

    ``expected``: the size the caller expects (exact, or an upper bound), or None.
    Every range of it is asked at once; the first answer's head gives the size, and
    what lies past the expected bytes is asked then (one more round trip)."""

    def __init__(self, store: DownloadingStore, key: str, expected: int | None) -> None:
        self._store, self.key, self._expected = store, key, expected
        self.size = 0
        self._etag = self._crc = ""
        self._held: _First | None = None
        self._first: _First  # set by _open
        self._later: list[asyncio.Task[None]] = []
        self._head: asyncio.Future[tuple[str, int]] | None = None  # the first answer's (ETag, size)
        self._out: asyncio.Future[memoryview] | None = None  # the caller's buffer, once placed

    async def _open(self) -> None:
        cfg, loop = self._store.config, asyncio.get_running_loop()
        most = max(1, min(cfg.max_concurrency, cfg.max_pool_connections))
        # Unknown: one range, whose answer tells the size (a blob of one range and a
        # header costs one request).
        want = self._expected or cfg.get_range_bytes + MAX_HEADER_BYTES
        plan = plan_ranges(0, max(1, want), cfg.get_range_bytes, most if self._expected else 1, MAX_HEADER_BYTES)
        self._head, self._out = loop.create_future(), loop.create_future()
        self._later = [asyncio.ensure_future(self._range(a, b)) for a, b in plan[1:]]
        try:
            first = await _open_first(self._store, self.key, plan[0][1] - 1)
        except BaseException:
            await self._cancel()
            raise
        self._held, self._first = first, first
        self.size, self._etag, self._crc = first.size, first.etag, first.crc
        self._head.set_result((first.etag, first.size))
        if first.size > plan[-1][1] and first.length < first.size:  # more than expected: the rest now
            self._later += [asyncio.ensure_future(self._range(a, b))
                            for a, b in plan_ranges(plan[-1][1], first.size, cfg.get_range_bytes, most)]

    async def _cancel(self) -> None:
        later, self._later = self._later, []
        for task in later:
            task.cancel()
        await asyncio.gather(*later, return_exceptions=True)

    async def _range(self, start: int, end: int) -> None:
        """Bytes ``start`` to ``end - 1`` (or to the object's end, if sooner) into the
        caller's buffer once it is placed; nothing when the object ends before ``start``.
        A hedge reads into a buffer of its own, copied over the range only if it wins."""
        assert self._head is not None and self._out is not None
        head, placed, store = self._head, self._out, self._store

        async def _get(t: Transport, watch: Stopwatch, own: bool) -> memoryview | None:
            watch.start()
            etag = head.result()[0] if head.done() and strong_etag(head.result()[0]) else None
            async with t.open_range(self.key, start, end - 1, etag) as answer:
                first_byte_s = watch.elapsed()
                span = check_answer(answer.status, answer.headers, start, end - 1, self.key)
                with watch.wait():
                    first_etag, size = await head
                if span.total != size:
                    raise ObjectChanged("GET", self.key, f"object is {span.total} bytes now, was {size}")
                if answer.headers.get("ETag") != first_etag:  # strong: byte for byte
                    raise ObjectChanged("GET", self.key, f"a range has ETag {answer.headers.get('ETag')!r}, "
                                        f"the first {first_etag!r}")
                n = span.length or 0
                if own:
                    into = memoryview(bytearray(n))
                else:
                    with watch.wait():
                        into = (await placed)[start : start + n]
                await answer.read_into(into)
                store.hedging.record(first_byte_s, watch.elapsed() - first_byte_s, n)
                return into if own else None

        try:
            won = await race(store, end - start, lambda w: store._call("GET", self.key, lambda t: _get(t, w, False)),
                             lambda w: _hedge(store, self.key, lambda t: _get(t, w, True), permit=True))
            if won is not None:  # the hedge's answer, whole, over whatever the cancelled primary wrote
                (await placed)[start : start + len(won)] = won
        except StoreRequestError as exc:
            if exc.status == 416 and start >= (await head)[1]:
                return  # the object ends before this range: the expected size was too large
            if exc.status not in (412, 416):
                raise
            raise ObjectChanged("GET", self.key, "replaced between two ranges of one GET", status=exc.status,
                                code=exc.code) from exc

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` (exactly :attr:`size` bytes) with the object, CRC-checked."""
        if len(out) != self.size:
            raise ValueError(f"read_into needs {self.size} bytes, got {len(out)}")
        for attempt in (1, 2):
            try:
                await self._fill(out)
                break
            except ObjectChanged:
                if attempt == 2:
                    raise
                await self._reopen()
        self._store.stats.bytes_downloaded += len(out)
        if self._store.config.checksum_algorithm != "none" and self._crc:
            actual = f"{await crc32_of(out):08x}"
            if actual != self._crc:
                self._store.stats.integrity_failures += 1
                raise IntegrityError("GET", self.key, f"CRC32 {actual} != stored {self._crc}")

    async def aclose(self) -> None:
        await self._cancel()
        held, self._held = self._held, None
        if held is not None:
            await held.scope.aclose()

    async def _reopen(self) -> None:
        size = self.size
        await self.aclose()
        self._expected = size
        await self._open()
        if self.size != size:
            raise ObjectChanged("GET", self.key, f"object is {self.size} bytes now, was {size}")

    async def _fill(self, out: memoryview) -> None:
        # The later ranges were asked with the first (or as soon as its head gave the
        # size): a blob costs one range's time plus a round trip, or two when it is
        # larger than expected.
        assert self._out is not None
        first, etag = self._first, self._etag if strong_etag(self._etag) else None
        if etag is None and first.length < len(out):
            # Nothing tells two ranged answers of this object from answers of two
            # objects (a weak tag may name both, and If-Match never matches it).
            await self.aclose()  # the first body unread: its connection is not reused
            self._crc = await get_whole(self._store, self.key, out)
            return
        self._out.set_result(out)
        later, self._later = self._later, []
        await all_or_none([self._fill_first(out, etag), *(_joined(task) for task in later)])

    async def _fill_first(self, out: memoryview, etag: str | None) -> None:
        first = self._first
        held, self._held = self._held, None
        assert held is first
        try:
            # The attempt's deadline, entered in this task (never the opener's): it
            # ends as a StoreTimeout here, retried below, however long ago the open was.
            async with held.scope, first.lease.bounded():
                if first.data is not None:
                    out[:] = first.data
                else:
                    began = self._store.hedging.clock.now()
                    await first.answer.read_into(out[: first.length])
                    self._store.hedging.record(first.first_byte_s, self._store.hedging.clock.now() - began,
                                               first.length)
        except Exception as exc:  # noqa: BLE001 - mapped; a cut body is asked again
            error = to_store_error("GET", self.key, exc)
            if error is None:
                raise  # not a store failure: shown as it is
            if not error.transient:
                raise error from exc
            if self._store.config.max_attempts == 1:  # this read was the request's one attempt
                self._store.stats.failures += 1
                self._store.breaker.failure(error.reason)
                raise error from exc
            self._store.stats.retries += 1  # the first read was this request's first attempt
            await get_range(self._store, self.key, out, 0, first.length, etag, spent=1)


async def _joined(task: asyncio.Task[None]) -> None:
    await task  # cancelled with its waiter (all_or_none)


async def get_range(
    store: DownloadingStore, key: str, out: memoryview, start: int, end: int, etag: str | None, *, spent: int = 0
) -> None:
    """``out[start:end]`` from bytes ``start`` to ``end - 1`` of ``key``, with ``If-Match:
    etag``; a 412, another ETag (a server may ignore If-Match) or another size is
    :class:`ObjectChanged`. ``spent``: attempts of ``max_attempts`` used already."""
    async def _get(t: Transport) -> None:
        async with t.open_range(key, start, end - 1, etag) as answer:
            span = check_answer(answer.status, answer.headers, start, end - 1, key)
            if span.total != len(out):
                raise ObjectChanged("GET", key, f"object is {span.total} bytes now, was {len(out)}")
            if etag is not None and answer.headers.get("ETag") != etag:  # strong: byte for byte
                raise ObjectChanged("GET", key, f"a later range has ETag {answer.headers.get('ETag')!r}, the first {etag!r}")
            await answer.read_into(out[start:end])

    try:
        await store._call("GET", key, _get, spent=spent)
    except StoreRequestError as exc:
        if exc.status != 412:
            raise
        raise ObjectChanged("GET", key, "replaced between two ranges of one GET", status=412, code=exc.code) from exc


async def get_whole(store: DownloadingStore, key: str, out: memoryview) -> str:
    """All of ``key`` into ``out`` with one unranged GET (one answer: one object); its
    CRC metadata. Another size is :class:`ObjectChanged`."""
    async def _get(t: Transport) -> str:
        async with t.open_range(key, 0, None) as answer:
            span = check_answer(answer.status, answer.headers, 0, len(out) - 1, key)
            data = None if span.length is not None else await answer.read_to_end(store.config.max_blob_bytes)
            size = span.total if data is None else len(data)  # chunked: known at its end
            if size != len(out):
                raise ObjectChanged("GET", key, f"object is {size} bytes now, was {len(out)}")
            if data is None:
                await answer.read_into(out)
            else:
                out[:] = data
            return answer.headers.get(_CRC_HEADER, "")

    return await store._call("GET", key, _get)


def strong_etag(etag: str) -> bool:
    """Whether ``etag`` names one version byte for byte (RFC 9110 8.8.1): not absent,
    not weak (``W/"..."``)."""
    return bool(etag) and not etag.startswith("W/")


@contextlib.asynccontextmanager
async def open_download(store: DownloadingStore, key: str, expected: int | None = None) -> AsyncIterator[Download]:
    """The object ``key``'s :class:`Download`, released on exit; ``expected``: the size
    the caller expects, if it knows one (exact, or an upper bound)."""
    download = Download(store, key, expected)
    try:
        await download._open()
        yield download
    finally:
        await download.aclose()
