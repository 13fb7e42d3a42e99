"""Producer side: publish encoder outputs to S3 without stalling the model step.

``publish`` runs inside vLLM's model step: it takes a buffer or loan of the in-flight
bound, queues the device copy and the upload, and returns; the I/O loop writes the header
and uploads. Owns the in-flight bound (``max_inflight_bytes``: block or drop) and upload
jobs, each of which ends uploaded, already there, spooled or dropped. Does not own
retries (the store), the spool's files, buffer memory, the device copy or keys.
Importable without S3 client libraries. Details: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ec_s3.blob.codec import BlobError, BlobLayout, BlobMeta, tensor_bytes
from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.store.body import BufferChain  # stdlib only: no S3 client library
from ec_s3.store.errors import PutOutcome, StoreError, StoreUnavailable  # stdlib only too
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.device import HostCopier
from ec_s3.transfer.hostpool import HostBuffer, HostBufferPool

if TYPE_CHECKING:
    from ec_s3.store.client import S3Store
    from ec_s3.transfer.spool import Spool

__all__ = ["BlobPublisher"]

_SEEN_LIMIT = 65536
_SLOW_SAVE_WARN_S = 1.0
# copy_cpu_outputs: the loop copies in slices, letting other uploads' I/O run in between.
_COPY_SLICE = 4 * 1024 * 1024
# Header room: a blob's header is planned on the loop, after the step has placed the
# data, so the step reserves an upper bound. JSON escapes a character in at most 12
# bytes (a surrogate pair); identifiers longer than the codec stores are kept as a digest.
_ESCAPED_CHAR_BYTES = 12
_MAX_STORED_IDENTIFIER_CHARS = 1024
_HEADER_MARGIN = 64  # dtype names differ in length; padding to 8


class _Job:
    __slots__ = ("identifier", "key", "dtype", "shape", "nbytes", "room", "buf", "event", "source", "settled", "shared",
                 "object_metadata")

    def __init__(self, identifier: str, key: str, tensor: torch.Tensor, nbytes: int, room: int, buf: HostBuffer,
                 object_metadata: dict[str, str] | None = None) -> None:
        self.identifier = identifier
        self.key = key
        self.object_metadata = object_metadata  # stored with the blob (placeholder metadata)
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.nbytes = nbytes
        self.room = room  # the data starts here in buf; the header ends here
        self.buf: HostBuffer | None = buf
        self.event: Any = None  # CUDA event: device->host copy done
        self.source: torch.Tensor | None = None  # CPU tensor: sent in place (buf is a loan) or copied into buf
        self.settled = False  # buffer and pending count given back
        self.shared = False  # a spool writer thread may still read the buffer: never lend it again


class BlobPublisher:
    """Uploads encoder outputs in the background, bounded in bytes in flight."""

    def __init__(
        self, store: S3Store, config: ECS3Config, *, namespace: str, producer: str, counters: Counters,
        spool: Spool | None = None, copy_cpu_outputs: bool = False,
    ) -> None:
        """``copy_cpu_outputs``: stage CPU tensors in pool buffers too (copied on the
        loop) instead of sending them in place; measured no better for memory, kept so
        that benches and tests exercise the buffer path without a GPU."""
        self._store = store
        self._copy_cpu = copy_cpu_outputs
        self._spool = spool
        self._tasks: set[asyncio.Task[None]] = set()
        self._config = config
        self._namespace = namespace
        self._producer = producer
        self._counters = counters
        # Plain host memory until the first CUDA tensor asks for pinned buffers.
        self._pool = HostBufferPool(config.max_inflight_bytes)
        # key -> when it was last published or seen in the bucket; trusted for
        # present_ttl_s (gc or a lifecycle rule may delete a blob after that).
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._pending = 0
        self._idle = threading.Condition()
        self._copier = HostCopier()
        self._seen_unexpected: set[type[BaseException]] = set()
        # Jobs the loop has not picked up yet. One wake-up hands over all of them: the
        # flag is set by the step when it posts a wake-up, cleared by the loop's drain.
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake_pending = False
        self._deferred = False
        base = BlobLayout.plan(BlobMeta("", torch.float32, (1 << 62,) * 4, namespace, producer))
        self._header_base = len(base.header) + _HEADER_MARGIN
        # Called on the loop each time the last upload in flight is done (the worker
        # flushes its stats snapshot then: ec_s3.transfer.shared_stats).
        self.on_idle: Callable[[], None] | None = None

    @property
    def pool(self) -> HostBufferPool:
        """The in-flight bound: ``capacity``, ``used`` (lent out), ``held``, ``peak``."""
        return self._pool

    # ------------------------------------------------------------ model-step side
    def publish(self, identifier: str, tensor: torch.Tensor, key: str,
                object_metadata: dict[str, str] | None = None) -> bool:
        """Start publishing ``tensor`` under ``key`` (with ``object_metadata`` as the
        object's S3 metadata); returns False if it was skipped."""
        seen = self._seen.get(key)
        if seen is not None and time.monotonic() - seen <= self._config.present_ttl_s:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        room = self._header_room(identifier)
        pool = self._pool_for(tensor)
        buffered = tensor.is_cuda or self._copy_cpu
        if nbytes > self._config.max_blob_bytes or not pool.fits(room + nbytes, buffer=buffered):
            self._counters.inc("upload_dropped")
            logger.warning(
                "ec-s3: encoder output %s is %d bytes, above max_blob_bytes/max_inflight_bytes; not published",
                identifier[:64], nbytes,
            )
            return False
        buf = self._reserve(pool, room + nbytes, identifier, buffer=buffered)
        if buf is None:
            return False
        self._remember(key)
        job = _Job(identifier, key, tensor, nbytes, room, buf, object_metadata)
        try:
            if tensor.is_cuda:
                self._start_device_copy(job, tensor)
            else:
                job.source = tensor  # detached on the loop (tensor_bytes): one C call less in the step
        except Exception as exc:  # noqa: BLE001 - a failed copy must not crash the step
            self._forget(key)
            self._give_back(job)
            self._counters.inc("upload_failed")
            logger.warning("ec-s3: could not stage %s for upload: %s", identifier[:64], exc)
            return False
        with self._idle:
            self._pending += 1
        self._queue.append(job)
        if not self._wake_pending and not self._deferred and not self._post_wakeup():
            return False
        return True

    def defer_wakeups(self) -> None:
        """Queue saves without waking the loop until :meth:`wake` (the end of the step):
        the step hands its uploads over in one wake-up. A deferral left open is ended
        here, so queued jobs wait one step at most."""
        if self._deferred:
            self.wake()
        self._deferred = True

    def wake(self) -> None:
        """End a deferral; wake the loop if jobs are queued and no wake-up is pending."""
        self._deferred = False
        if self._queue and not self._wake_pending:
            self._post_wakeup()

    def _post_wakeup(self) -> bool:
        """Ask the loop to drain the queue; False if the loop is gone (then every queued
        job ends here, counted)."""
        self._wake_pending = True
        try:
            self._store.background.call_soon(self._drain)
        except Exception as exc:  # noqa: BLE001 - the I/O loop is gone (shutdown): never crash the step
            self._wake_pending = False
            self._abandon_queued(f"the I/O loop is not running ({exc})")
            return False
        return True

    def _abandon_queued(self, reason: str) -> None:
        while True:
            try:
                job = self._queue.popleft()
            except IndexError:
                return
            self._forget(job.key)
            self._settle(job)
            self._counters.inc("upload_failed")
            logger.warning("ec-s3: cannot upload %s: %s", job.identifier[:64], reason)

    def _header_room(self, identifier: str) -> int:
        """Bytes reserved in front of the data for the header (an upper bound)."""
        chars = min(len(identifier), _MAX_STORED_IDENTIFIER_CHARS)
        return -(-(self._header_base + _ESCAPED_CHAR_BYTES * chars) // 8) * 8

    def _pool_for(self, tensor: torch.Tensor) -> HostBufferPool:
        if tensor.is_cuda and not self._pool.pinned and self._pool.used == 0:
            # Device copies need pinned buffers to run asynchronously; decided at the
            # first CUDA tensor, so a CPU-only host never touches CUDA. Nothing is lent
            # out of the old pool, so no job returns a buffer to it later.
            self._pool.clear()
            self._pool = HostBufferPool(self._config.max_inflight_bytes, pinned=True)
        return self._pool

    def _reserve(self, pool: HostBufferPool, nbytes: int, identifier: str, *, buffer: bool) -> HostBuffer | None:
        buf = pool.try_acquire(nbytes, buffer=buffer)
        if buf is not None:
            return buf
        if self._config.backpressure == "drop":
            self._counters.inc("upload_dropped")
            logger.warning(
                "ec-s3: %d bytes already waiting for upload (max_inflight_bytes=%d); dropping %s",
                pool.used, pool.capacity, identifier[:64],
            )
            return None
        # The loop must run what is queued, or the room this save waits for never comes.
        self.wake()
        started = time.monotonic()
        warned = False
        while (buf := pool.acquire(nbytes, timeout=_SLOW_SAVE_WARN_S, buffer=buffer)) is None:
            if not warned:
                warned = True
                logger.warning(
                    "ec-s3: save_caches waiting for upload room (%d of %d bytes in flight); the store is "
                    "slower than the encoder: raise max_inflight_bytes or use backpressure=drop",
                    pool.used, pool.capacity,
                )
        self._counters.inc("save_blocked_seconds", time.monotonic() - started)
        return buf

    def _start_device_copy(self, job: _Job, tensor: torch.Tensor) -> None:
        """Queue the device→pinned-host copy on a side stream; never syncs the host."""
        assert job.buf is not None and job.buf.data is not None
        job.event = self._copier.start(tensor, job.buf.data[job.room : job.room + job.nbytes])

    def _remember(self, key: str) -> None:
        self._seen[key] = time.monotonic()
        self._seen.move_to_end(key)
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _forget(self, key: str) -> None:
        self._seen.pop(key, None)

    def mark_present(self, key: str) -> None:
        """Record that ``key`` is already in the bucket (e.g. it was loaded from there)."""
        self._remember(key)

    # ------------------------------------------------------------ loop side
    def _drain(self) -> None:
        # The step thread that posted this wake-up wants the GIL back at once; the
        # uploads' Python (request building: milliseconds for a multipart upload) can
        # run when the step next waits (a device sync, the engine's socket I/O) instead
        # of making the step wait for a switch interval (5 ms). sleep(0) drops the GIL.
        time.sleep(0)
        # Cleared before popping: a job queued after this line posts a new wake-up or
        # is popped below, never neither.
        self._wake_pending = False
        self._counters.set_gauge("inflight_bytes", self._pool.used)
        while True:
            try:
                job = self._queue.popleft()
            except IndexError:
                return
            self._counters.inc("upload_started")
            self._spawn(job)

    def _spawn(self, job: _Job) -> None:
        try:
            task = asyncio.ensure_future(self._upload(job))
        except BaseException:
            self._settle(job)
            raise
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _task: self._on_done(job))

    def _on_done(self, job: _Job) -> None:
        # A task cancelled before its first step never ran _upload, finally included.
        if not job.settled:
            self._drop(job, "cancelled before it started", "upload_abandoned", quiet=False)
            self._settle(job)

    def _give_back(self, job: _Job) -> None:
        """Return ``job``'s buffer to the pool, unless a device copy may still write into it
        or a spool writer read it (then only its room comes back; it is freed when unused)."""
        buf, job.buf = job.buf, None
        if buf is None:
            return
        event, job.event = job.event, None
        if job.shared or (event is not None and not event.query()):
            self._pool.discard(buf)  # torch frees the pinned block once the copy is done
        else:
            self._pool.release(buf)

    def _settle(self, job: _Job) -> None:
        """Give ``job``'s buffer and pending count back, once."""
        if job.settled:
            return
        job.settled = True
        job.source = None
        self._give_back(job)
        self._counters.set_gauge("inflight_bytes", self._pool.used)
        with self._idle:
            self._pending -= 1
            idle = self._pending == 0
            self._idle.notify_all()
        if idle and self.on_idle is not None:
            try:
                self.on_idle()
            except Exception as exc:  # noqa: BLE001 - a hook must never break an upload's clean-up
                logger.debug("ec-s3: the publisher's idle hook failed: %r", exc)

    async def _upload(self, job: _Job) -> None:
        body: memoryview | BufferChain | None = None
        try:
            body = await self._body(job)
            started = time.monotonic()
            outcome = await self._store.put_async(job.key, body, metadata=job.object_metadata)
            self._counters.observe("upload_seconds", time.monotonic() - started)
            if outcome is PutOutcome.CREATED:
                self._counters.inc("blobs_uploaded")
                self._counters.inc("bytes_uploaded", len(body))
            else:
                self._counters.inc("upload_already_present")
        except BlobError as exc:
            self._drop(job, f"cannot encode: {exc}", "upload_failed", quiet=False)
        except asyncio.CancelledError:
            # Shutting down with the upload unfinished: keep it in the spool if any.
            await self._spool_or_drop(job, body, "shutdown", cancelled=True)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the store or the copy raises, the job ends here
            if isinstance(exc, StoreUnavailable):
                await self._spool_or_drop(job, body, exc.reason)
            elif isinstance(exc, StoreError):
                # The store answered and refused (403, a bad request): retrying the same
                # bytes later would be refused again.
                self._drop(job, str(exc), "upload_failed", quiet=False)
            else:
                kind = type(exc)
                first = kind not in self._seen_unexpected
                self._seen_unexpected.add(kind)
                logger.warning("ec-s3: unexpected error uploading %s: %r", job.key, exc, exc_info=first)
                await self._spool_or_drop(job, body, f"{kind.__name__}: {exc}")
        finally:
            body = None
            self._settle(job)

    async def _spool_or_drop(
        self, job: _Job, body: memoryview | BufferChain | None, reason: str, *, cancelled: bool = False
    ) -> None:
        """Retries are spent (or we are shutting down): spool the blob, else drop it."""
        if self._spool is not None and body is not None:
            try:
                if await self._spool.save(job.key, body):
                    return  # still in _seen: the spool will deliver it
            except asyncio.CancelledError:
                # The spool's writer thread goes on reading the body after we stop waiting.
                job.shared = True
                raise
            except Exception as exc:  # noqa: BLE001 - the blob is dropped below, counted
                logger.warning("ec-s3: cannot spool %s: %r", job.key, exc)
        # During an outage the breaker logs once; per-item lines would flood the log.
        self._drop(job, reason, "upload_abandoned" if cancelled else "upload_failed", quiet=self._store.breaker.is_open)

    def _drop(self, job: _Job, reason: str, counter: str, *, quiet: bool) -> None:
        self._forget(job.key)
        self._counters.inc(counter)
        log = logger.debug if quiet else logger.warning
        log("ec-s3: upload of %s to %s dropped: %s", job.identifier[:64], job.key, reason)

    async def _body(self, job: _Job) -> memoryview | BufferChain:
        """The blob: ``[header | data]`` in the job's pinned buffer (CUDA), or the header
        and the tensor's own memory, sent without joining them (CPU)."""
        buf = job.buf
        assert buf is not None
        layout = BlobLayout.plan(BlobMeta(job.identifier, job.dtype, job.shape, self._namespace, self._producer))
        if buf.data is None:
            assert job.source is not None
            return BufferChain([layout.header, memoryview(tensor_bytes(job.source).numpy())])
        start = job.room - layout.data_offset
        if start < 0 or layout.data_nbytes != job.nbytes:
            raise BlobError("header_size", f"header of {layout.data_offset} bytes exceeds its {job.room}-byte room")
        if job.event is not None:
            event = job.event
            while not event.query():
                await asyncio.sleep(0.0005)
        else:
            await self._copy_in(job, buf)
        buf.view(start, job.room)[:] = layout.header
        return buf.view(start, job.room + job.nbytes)

    @staticmethod
    async def _copy_in(job: _Job, buf: HostBuffer) -> None:
        """Copy a CPU tensor into its buffer (``copy_cpu_outputs``), then let it go."""
        assert job.source is not None and buf.data is not None
        src = tensor_bytes(job.source).numpy()
        dst = buf.data[job.room : job.room + job.nbytes].numpy()
        for lo in range(0, job.nbytes, _COPY_SLICE):
            if lo:
                await asyncio.sleep(0)  # other uploads' I/O between slices
            dst[lo : lo + _COPY_SLICE] = src[lo : lo + _COPY_SLICE]  # numpy releases the GIL here
        job.source = None

    # ------------------------------------------------------------ shutdown
    @property
    def pending(self) -> int:
        return self._pending

    def shutdown(self, timeout: float) -> tuple[int, int]:
        """Wait up to ``timeout`` s for pending uploads, then spool (or abandon) what is
        left. Returns (pending at start, abandoned)."""
        pending = self._pending
        left = self.flush(timeout)
        if left:
            for task in list(self._tasks):
                self._store.background.call_soon(task.cancel)
            self.flush(10.0 if self._spool is not None else 1.0)  # spooling writes to disk
        abandoned = int(self._counters.get("upload_abandoned"))
        if self._spool is not None:
            self._spool.stop()
        self._pool.clear()
        return pending, abandoned

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for pending uploads; returns how many remain."""
        self.wake()  # nothing queued may wait for a step end that is not coming
        if self._queue and not self._store.background.is_running:
            self._abandon_queued("the I/O loop is not running")
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
            return self._pending
