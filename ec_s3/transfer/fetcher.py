"""Lookups and downloads for the scheduler side, run on the I/O loop.

The scheduler starts a lookup (:meth:`ItemFetcher.start`, returns at once) and collects
results with :meth:`ItemFetcher.drain`. A consumer's lookup is a GET into a staging slot
plus full validation; a producer's is a HEAD. Every lookup started reports exactly one
:data:`FetchResult`, whatever happens to it. Owns lookups in flight and the mapping of
outcomes to results. Does not own item states or retries (the scheduler), slot lifetimes
(staging) or S3 (the store). Lookup vs fetch: the glossary in docs/architecture.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import threading
import time

from ec_s3.blob.codec import BlobError, BlobExpectation, decode_blob
from ec_s3.log import logger
from ec_s3.transfer.staging import NoStagingSpace, StagingArea, StagingSlot
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import Download, IntegrityError, ObjectNotFound, S3Store, StoreError, StoreUnavailable

__all__ = ["Failed", "FetchResult", "Invalid", "ItemFetcher", "Missing", "NoSpace", "Present", "Staged"]


@dataclasses.dataclass(frozen=True)
class Staged:
    slot: StagingSlot
    data_offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Present:
    size: int


@dataclasses.dataclass(frozen=True)
class Missing:
    pass


@dataclasses.dataclass(frozen=True)
class Invalid:
    reason: str


@dataclasses.dataclass(frozen=True)
class Failed:
    reason: str
    transient: bool = False  # throttling, 5xx, timeouts, connection errors
    outage: bool = False  # the store is down (circuit open), not just this request


@dataclasses.dataclass(frozen=True)
class NoSpace:
    pass


FetchResult = Staged | Present | Missing | Invalid | Failed | NoSpace


class ItemFetcher:
    def __init__(self, store: S3Store, staging: StagingArea | None, counters: Counters) -> None:
        self._store = store
        self._staging = staging
        self._counters = counters
        # deque.append/popleft are atomic: the loop appends, the scheduler pops.
        self._done: collections.deque[tuple[str, FetchResult]] = collections.deque()
        # Set with every result: an idle scheduler waits on it instead of spinning.
        self._arrived = threading.Event()
        self._seen_unexpected: set[type[BaseException]] = set()

    def start(self, key: str, expect: BlobExpectation | None, expected_size: int | None = None) -> None:
        """Look ``key`` up in the background: HEAD if ``expect`` is None, else fetch
        (every range at once when ``expected_size``, exact or an upper bound, is
        given), validate against ``expect`` and stage. Never raises; a lookup that
        cannot even start reports ``Failed`` at the next :meth:`drain`."""
        try:
            self._store.background.call_soon(self._spawn, key, expect, expected_size)
        except Exception as exc:  # noqa: BLE001 - the I/O loop is gone (shutdown)
            self._report(key, Failed(f"I/O loop unavailable: {exc}"))

    def drain(self) -> list[tuple[str, FetchResult]]:
        self._arrived.clear()  # before popping: a result appended meanwhile sets it again
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def wait_for_result(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a result is ready to :meth:`drain` (True), the
        GIL released meanwhile. For a scheduler step that has nothing else to do."""
        return self._arrived.wait(timeout_s)

    def _report(self, key: str, result: FetchResult) -> None:
        self._done.append((key, result))
        self._arrived.set()

    def _spawn(self, key: str, expect: BlobExpectation | None, expected_size: int | None = None) -> None:
        coro = self._head(key) if expect is None else self._fetch(key, expect, expected_size)
        try:
            self._store.submit(coro)
        except Exception as exc:  # noqa: BLE001 - closed while shutting down
            coro.close()
            self._report(key, Failed(f"store closed: {exc}"))

    async def _head(self, key: str) -> None:
        result: FetchResult = Failed("lookup cancelled")
        try:
            info = await self._store.head_async(key)
            result = Missing() if info is None else Present(info.size)
        except StoreError as exc:
            result = self._failed(exc)
        except Exception as exc:  # noqa: BLE001 - a lookup must always report
            result = self._unexpected(key, exc)
        finally:
            self._report(key, result)

    def _failed(self, exc: StoreError) -> Failed:
        transient = isinstance(exc, StoreUnavailable)
        return Failed(exc.reason, transient=transient, outage=transient and self._store.breaker.is_open)

    def _unexpected(self, key: str, exc: Exception) -> Failed:
        kind = type(exc)
        # The traceback once per exception type: enough to fix it, not a flood.
        first = kind not in self._seen_unexpected
        self._seen_unexpected.add(kind)
        logger.warning("ec-s3: unexpected error looking up %s: %r", key, exc, exc_info=first)
        return Failed(f"{kind.__name__}: {exc}")

    async def _fetch(self, key: str, expect: BlobExpectation, expected_size: int | None = None) -> None:
        result: FetchResult = Failed("lookup cancelled")
        try:
            result = await self._download(key, expect, expected_size)
        except ObjectNotFound:
            result = Missing()
        except (BlobError, IntegrityError) as exc:
            result = Invalid(exc.reason if isinstance(exc, BlobError) else "checksum")
            self._counters.inc("invalid_blobs")
            logger.warning("ec-s3: blob %s is invalid (%s); it will not be used", key, exc)
        except StoreError as exc:
            result = self._failed(exc)
        except Exception as exc:  # noqa: BLE001 - a lookup must never take the engine down
            result = self._unexpected(key, exc)
        finally:
            if isinstance(result, NoSpace):
                self._counters.inc("staging_no_space")
            self._report(key, result)

    async def _download(self, key: str, expect: BlobExpectation, expected_size: int | None) -> Staged | NoSpace:
        """The GET in its two phases: the size, a staging slot of that size (or
        NoSpace, the answer released unread), then the bytes straight into it."""
        assert self._staging is not None
        started = time.monotonic()
        async with self._store.open_async(key, expected_size) as download:
            try:
                slot = self._staging.allocate(hashlib.sha256(key.encode()).hexdigest()[:40], download.size)
            except NoStagingSpace:
                slot = None
            if slot is None:
                return NoSpace()
            try:
                staged = await self._stage(download, slot, expect)
            except BaseException:
                self._staging.discard(slot)
                raise
        self._counters.inc("blobs_downloaded")
        self._counters.inc("bytes_downloaded", slot.nbytes)
        self._counters.observe("download_seconds", time.monotonic() - started)
        return staged

    async def _stage(self, download: Download, slot: StagingSlot, expect: BlobExpectation) -> Staged:
        """Read ``download`` into ``slot``, validate it, mark the slot ready."""
        assert self._staging is not None
        mm = self._staging.map(slot, writable=True)  # through its open file: the name may go
        try:
            buf = memoryview(mm)
            try:
                await download.read_into(buf)
                decoded = decode_blob(buf, expect)
                staged = Staged(slot=slot, data_offset=decoded.data_offset,
                                dtype=str(decoded.tensor.dtype).removeprefix("torch."), shape=tuple(decoded.tensor.shape))
                del decoded  # its tensor views the slot's mapping, closed below
            finally:
                with contextlib.suppress(BufferError):
                    buf.release()
        finally:
            with contextlib.suppress(BufferError):
                mm.close()
        assert self._staging is not None
        self._staging.mark_ready(slot)
        return staged
