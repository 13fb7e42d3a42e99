"""Producer side: publish encoder outputs to S3 without stalling the model step.

``publish`` runs inside vLLM's model step, so it does no network I/O, no
serialization and no blocking device sync. On CUDA it records the copy of the
encoder output into a pinned host buffer on a side stream (after an event on the
current stream) and returns; on CPU it keeps a reference. The background loop waits
for the copy, lays the blob out around it (the pinned buffer already has the header
in front, so the buffer *is* the upload body) and uploads it with a conditional put.

Memory is bounded by ``max_inflight_bytes``: when full, ``block`` makes the step
wait for room (backpressure slows the encoder to the store's pace) and ``drop``
skips the upload and counts it.

Every upload ends in one of: uploaded, already there, spooled, or dropped with a
count and a log line, whatever the store raises; its bytes go back to the budget on
every path, a task cancelled before it first ran and a loop that is gone included.

Owns the in-flight budget and upload jobs. Does not own retries (the store), the
outage spool's files (:mod:`ec_s3.transfer.spool`) or which key an output gets (the
connector's key space).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

import torch

from ec_s3.blob.codec import BlobError, BlobLayout, BlobMeta, tensor_bytes
from ec_s3.config import ECS3Config
from ec_s3.log import logger
from ec_s3.transfer.spool import Spool
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import BufferChain, PutOutcome, S3Store, StoreError, StoreUnavailable

__all__ = ["BlobPublisher", "InflightBudget"]

_SEEN_LIMIT = 65536
_SLOW_SAVE_WARN_S = 1.0


class InflightBudget:
    """A byte semaphore shared by the model step (acquire) and the loop (release)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def try_acquire(self, n: int) -> bool:
        with self._cond:
            if self.used + n > self.capacity:
                return False
            self._take(n)
            return True

    def acquire(self, n: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.used + n > self.capacity:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._take(n)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)


class _Job:
    __slots__ = ("identifier", "key", "layout", "host", "event", "source", "enqueued", "settled")

    def __init__(self, identifier: str, key: str, layout: BlobLayout) -> None:
        self.identifier = identifier
        self.key = key
        self.layout = layout
        self.host: torch.Tensor | None = None  # pinned [header | data] (CUDA path)
        self.event: Any = None  # CUDA event: host copy done
        self.source: torch.Tensor | None = None  # CPU tensor to lay out on the loop
        self.enqueued = time.monotonic()
        self.settled = False  # budget and pending count given back


class BlobPublisher:
    """Uploads encoder outputs in the background, bounded in bytes in flight."""

    def __init__(
        self, store: S3Store, config: ECS3Config, *, namespace: str, producer: str, counters: Counters,
        spool: Spool | None = None,
    ) -> None:
        self._store = store
        self._spool = spool
        self._tasks: set[asyncio.Task[None]] = set()
        self._config = config
        self._namespace = namespace
        self._producer = producer
        self._counters = counters
        self.budget = InflightBudget(config.max_inflight_bytes)
        # key -> when it was last published or seen in the bucket; trusted for
        # present_ttl_s (gc or a lifecycle rule may delete a blob after that).
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._pending = 0
        self._idle = threading.Condition()
        self._stream: Any = None
        self._seen_unexpected: set[type[BaseException]] = set()

    # ------------------------------------------------------------ model-step side
    def publish(self, identifier: str, tensor: torch.Tensor, key: str) -> bool:
        """Start publishing ``tensor`` under ``key``; returns False if it was skipped."""
        seen = self._seen.get(key)
        if seen is not None and time.monotonic() - seen <= self._config.present_ttl_s:
            return False
        try:
            meta = BlobMeta(identifier, tensor.dtype, tuple(tensor.shape), self._namespace, self._producer)
            layout = BlobLayout.plan(meta)
        except BlobError as exc:
            self._counters.inc("upload_failed")
            logger.warning("ec-s3: cannot publish %s: %s", identifier[:64], exc)
            return False
        nbytes = layout.total_nbytes
        if nbytes > self._config.max_blob_bytes or nbytes > self.budget.capacity:
            self._counters.inc("upload_dropped")
            logger.warning(
                "ec-s3: encoder output %s is %d bytes, above max_blob_bytes/max_inflight_bytes; not published",
                identifier[:64], nbytes,
            )
            return False
        if not self._reserve(nbytes, identifier):
            return False
        self._remember(key)
        job = _Job(identifier, key, layout)
        try:
            if tensor.is_cuda:
                self._start_device_copy(job, tensor)
            else:
                job.source = tensor.detach()
        except Exception as exc:  # noqa: BLE001 - a failed copy must not crash the step
            self._forget(key)
            self.budget.release(nbytes)
            self._counters.inc("upload_failed")
            logger.warning("ec-s3: could not stage %s for upload: %s", identifier[:64], exc)
            return False
        with self._idle:
            self._pending += 1
        self._counters.inc("upload_started")
        self._counters.set_gauge("inflight_bytes", self.budget.used)
        try:
            self._store.background.call_soon(self._spawn, job)
        except Exception as exc:  # noqa: BLE001 - the I/O loop is gone (shutdown): never crash the step
            self._forget(key)
            self._settle(job)
            self._counters.inc("upload_failed")
            logger.warning("ec-s3: cannot upload %s: the I/O loop is not running (%s)", identifier[:64], exc)
            return False
        return True

    def _reserve(self, nbytes: int, identifier: str) -> bool:
        if self.budget.try_acquire(nbytes):
            return True
        if self._config.backpressure == "drop":
            self._counters.inc("upload_dropped")
            logger.warning(
                "ec-s3: %d bytes already waiting for upload (max_inflight_bytes=%d); dropping %s",
                self.budget.used, self.budget.capacity, identifier[:64],
            )
            return False
        started = time.monotonic()
        warned = False
        while not self.budget.acquire(nbytes, timeout=_SLOW_SAVE_WARN_S):
            if not warned:
                warned = True
                logger.warning(
                    "ec-s3: save_caches waiting for upload room (%d of %d bytes in flight); the store is "
                    "slower than the encoder: raise max_inflight_bytes or use backpressure=drop",
                    self.budget.used, self.budget.capacity,
                )
        self._counters.inc("save_blocked_seconds", time.monotonic() - started)
        return True

    def _start_device_copy(self, job: _Job, tensor: torch.Tensor) -> None:
        """Queue device→pinned-host copy on a side stream; never syncs the host."""
        layout = job.layout
        host = torch.empty(layout.total_nbytes, dtype=torch.uint8, pin_memory=True)
        host[: layout.data_offset].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        current = torch.cuda.current_stream(tensor.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            src = tensor.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            host[layout.data_offset :].copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # The caching allocator must not reuse the tensor's memory before the copy.
        tensor.record_stream(self._stream)
        job.host, job.event = host, event

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

    def _settle(self, job: _Job) -> None:
        """Give ``job``'s bytes and pending count back, once."""
        if job.settled:
            return
        job.settled = True
        job.host = job.source = job.event = None
        self.budget.release(job.layout.total_nbytes)
        self._counters.set_gauge("inflight_bytes", self.budget.used)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    async def _upload(self, job: _Job) -> None:
        nbytes = job.layout.total_nbytes
        body: memoryview | BufferChain | None = None
        try:
            body = await self._body(job)
            started = time.monotonic()
            outcome = await self._store.put_async(job.key, body)
            self._counters.observe("upload_seconds", time.monotonic() - started)
            if outcome is PutOutcome.CREATED:
                self._counters.inc("blobs_uploaded")
                self._counters.inc("bytes_uploaded", nbytes)
            else:
                self._counters.inc("upload_already_present")
        except StoreUnavailable as exc:
            await self._spool_or_drop(job, body, exc.reason)
        except StoreError as exc:
            # The store answered and refused (403, a bad request): retrying the same
            # bytes later would be refused again.
            self._drop(job, str(exc), "upload_failed", quiet=False)
        except asyncio.CancelledError:
            # Shutting down with the upload unfinished: keep it in the spool if any.
            await self._spool_or_drop(job, body, "shutdown", cancelled=True)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the store or the copy raises, the job ends here
            kind = type(exc)
            first = kind not in self._seen_unexpected
            self._seen_unexpected.add(kind)
            logger.warning("ec-s3: unexpected error uploading %s: %r", job.key, exc, exc_info=first)
            await self._spool_or_drop(job, body, f"{kind.__name__}: {exc}")
        finally:
            self._settle(job)

    async def _spool_or_drop(
        self, job: _Job, body: memoryview | BufferChain | None, reason: str, *, cancelled: bool = False
    ) -> None:
        """Retries are spent (or we are shutting down): spool the blob, else drop it."""
        if self._spool is not None and body is not None:
            try:
                if await self._spool.save(job.key, body):
                    return  # still in _seen: the spool will deliver it
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
        if job.event is not None:
            event = job.event
            while not event.query():
                await asyncio.sleep(0.0005)
            assert job.host is not None
            return memoryview(job.host.numpy())
        assert job.source is not None
        # CPU: the header plus the tensor's own memory, sent without joining them.
        data = tensor_bytes(job.source)
        return BufferChain([job.layout.header, memoryview(data.numpy())])

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
        return pending, abandoned

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for pending uploads; returns how many remain."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(remaining)
            return self._pending

