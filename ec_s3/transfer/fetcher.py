"""Lookups and downloads for the scheduler side, run on the I/O loop.

The scheduler thread starts a lookup with :meth:`ItemFetcher.start` (a thread-safe
hand-off that returns at once) and collects finished ones with :meth:`drain` at its
next call. A consumer lookup is a GET straight into a staging slot followed by full
validation of the blob against what the model expects, so a "staged" answer means
the worker can use the bytes as they are. A producer lookup is only a HEAD.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import mmap
import time

from ec_s3.blob.codec import BlobError, BlobExpectation, decode_blob
from ec_s3.log import logger
from ec_s3.transfer.staging import StagingArea, StagingSlot, open_slot_view
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import IntegrityError, ObjectNotFound, S3Store, StoreError, StoreUnavailable

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


class _StagingFull(Exception):
    pass


class ItemFetcher:
    def __init__(self, store: S3Store, staging: StagingArea | None, counters: Counters) -> None:
        self._store = store
        self._staging = staging
        self._counters = counters
        # deque.append/popleft are atomic: the loop appends, the scheduler pops.
        self._done: collections.deque[tuple[str, FetchResult]] = collections.deque()

    def start(self, key: str, expect: BlobExpectation | None) -> None:
        """Look ``key`` up in the background: HEAD if ``expect`` is None, else fetch,
        validate against ``expect`` and stage."""
        self._store.background.call_soon(self._spawn, key, expect)

    def drain(self) -> list[tuple[str, FetchResult]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _spawn(self, key: str, expect: BlobExpectation | None) -> None:
        coro = self._head(key) if expect is None else self._fetch(key, expect)
        try:
            self._store.submit(coro)
        except StoreError:  # closed while shutting down
            self._done.append((key, Failed("store closed")))

    async def _head(self, key: str) -> None:
        try:
            info = await self._store.head_async(key)
            result: FetchResult = Missing() if info is None else Present(info.size)
        except StoreError as exc:
            result = self._failed(exc)
        self._done.append((key, result))

    def _failed(self, exc: StoreError) -> Failed:
        transient = isinstance(exc, StoreUnavailable)
        return Failed(exc.reason, transient=transient, outage=transient and self._store.breaker.is_open)

    async def _fetch(self, key: str, expect: BlobExpectation) -> None:
        assert self._staging is not None
        staging = self._staging
        held: list[tuple[StagingSlot, mmap.mmap]] = []

        def allocate(nbytes: int) -> memoryview:
            slot = staging.allocate(hashlib.sha256(key.encode()).hexdigest()[:40], nbytes)
            if slot is None:
                raise _StagingFull
            mm = open_slot_view(slot.path, writable=True)
            held.append((slot, mm))
            return memoryview(mm)

        started = time.monotonic()
        result: FetchResult
        try:
            buf = await self._store.get_async(key, allocate=allocate)
            decoded = decode_blob(buf, expect)
            result = Staged(
                slot=held[0][0],
                data_offset=decoded.data_offset,
                dtype=str(decoded.tensor.dtype).removeprefix("torch."),
                shape=tuple(decoded.tensor.shape),
            )
            del decoded
            buf.release()
            staging.mark_ready(held[0][0])
            self._counters.inc("blobs_downloaded")
            self._counters.inc("bytes_downloaded", held[0][0].nbytes)
            self._counters.observe("download_seconds", time.monotonic() - started)
        except ObjectNotFound:
            result = Missing()
        except _StagingFull:
            result = NoSpace()
        except (BlobError, IntegrityError) as exc:
            result = Invalid(exc.reason if isinstance(exc, BlobError) else "checksum")
            self._counters.inc("invalid_blobs")
            logger.warning("ec-s3: blob %s is invalid (%s); it will not be used", key, exc)
        except StoreError as exc:
            result = self._failed(exc)
        except Exception as exc:  # noqa: BLE001 - a lookup must never take the engine down
            result = Failed(f"{type(exc).__name__}: {exc}")
            logger.exception("ec-s3: unexpected error fetching %s", key)
        finally:
            for _, mm in held:
                with contextlib.suppress(BufferError):
                    mm.close()
        if not isinstance(result, Staged):
            for slot, _ in held:
                staging.discard(slot.name)
        self._done.append((key, result))
