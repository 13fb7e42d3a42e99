"""Worker counters made visible to the scheduler process through shared memory.

Each publishing worker mirrors its counters into a small JSON file under a sequence
lock (one per engine, under ``staging_dir``); the scheduler process collects those files
on its I/O loop and reports the increments as its own. Owns the file format and
directory, the writer's throttled flushes and progress marks, the reader's collection
and deltas. Does not own what the counters mean (:mod:`ec_s3.connector.metrics`) or when
vLLM asks for stats. Why it exists: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import json
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ec_s3.log import logger
from ec_s3.loop import BackgroundLoop
from ec_s3.transfer.counters import Counters, DeltaSource
from ec_s3.transfer.fsutil import create_exclusive, open_nofollow

__all__ = ["Progress", "SharedStatsReader", "SharedStatsWriter", "stats_dir", "stats_file_prefix"]

_SIZE = 256 * 1024
_HEADER = struct.Struct("<QI")  # sequence, payload length
_SAMPLES_KEPT = 512  # per histogram in the snapshot; the reader takes only the new ones
_FLUSH_EVERY_S = 0.25
_COLLECT_EVERY_S = 0.25  # how often the scheduler process reads the files (off the engine thread)
_HURRY_EVERY_S = 0.02  # the same while the scheduler waits for a step's counters (see hurry)
_SOON_GAP_S = 0.02  # flush_soon's least gap between two flushes: a busy engine marks every step
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


def stats_dir(staging_dir: str | os.PathLike[str]) -> Path:
    """The stats files' own directory under ``staging_dir``: listing it costs nothing
    however many other files (staging, other programs' in ``/dev/shm``) are beside it.
    Per user, since ``staging_dir`` may be shared; not named ``ec-s3-*``, which is what
    staging's clean-up of dead processes' directories looks at."""
    return Path(staging_dir) / f".ec-s3-counters-{os.geteuid()}"


def stats_file_prefix(engine_id: str) -> str:
    return f"ec-s3-stats-{_SAFE_ID.sub('_', engine_id)[:64]}-"


class SharedStatsWriter:
    """Mirrors one process's counters into ``<dir>/ec-s3-stats-<engine>-<pid>``.

    :meth:`flush` writes at most every ``_FLUSH_EVERY_S`` unless forced; callers flush
    from wherever counters move (the step, the I/O loop) and once, forced, at close.
    """

    def __init__(self, directory: str, engine_id: str, counters: Counters, sources: Sequence[DeltaSource] = ()) -> None:
        self._counters = counters
        self._sources = tuple(sources)  # pulled into counters before each flush
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {}
        self._sample_counts: dict[str, int] = {}
        self._last_flush = 0.0
        self._seq = 0
        self._step = 0  # the last engine step whose counters are in (mark_step)
        # Uploads in flight (the publisher's count), read at each flush before the counters.
        self.uploads_pending: Callable[[], int] = lambda: 0
        self._loop: BackgroundLoop | None = None
        self._flush_posted = False
        self.path = Path(directory) / f"{stats_file_prefix(engine_id)}{os.getpid()}"
        try:
            fd = create_exclusive(self.path)
        except FileExistsError:
            # A dead process's leftover under a recycled pid: ours to replace. Anything
            # else (a live writer, a file or link we do not own) makes this fail loudly.
            if _locked(self.path):
                raise
            self.path.unlink()
            fd = create_exclusive(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise
        self._fd = fd
        self._closed = False

    def flush(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < _FLUSH_EVERY_S:
            return
        with self._lock:
            if self._closed:
                return
            self._last_flush = now
            # Progress first: an upload counted as done below was done before this read.
            progress = {"step": self._step, "uploads_pending": int(self.uploads_pending())}
            for source in self._sources:
                self._counters.pull(source)
            delta = self._counters.take_samples()
            for name, values in delta.items():
                kept = self._samples.setdefault(name, [])
                kept.extend(values)
                del kept[:-_SAMPLES_KEPT]
                self._sample_counts[name] = self._sample_counts.get(name, 0) + len(values)
            snapshot = {
                "counters": self._counters.cumulative(),
                "gauges": self._counters.gauges(),
                "samples": self._samples,
                "sample_counts": self._sample_counts,
                "progress": progress,
            }
            payload = json.dumps(snapshot, separators=(",", ":")).encode()
            if _HEADER.size + len(payload) > _SIZE:  # pragma: no cover - ~30 counters + 2×512 floats
                snapshot["samples"] = {}
                payload = json.dumps(snapshot, separators=(",", ":")).encode()
            self._seq += 1  # odd: write in progress
            _HEADER.pack_into(self._map, 0, self._seq, 0)
            self._map[_HEADER.size : _HEADER.size + len(payload)] = payload
            self._seq += 1  # even: consistent
            _HEADER.pack_into(self._map, 0, self._seq, len(payload))

    def mark_step(self, step: int) -> None:
        """The counters of engine step ``step`` are in (its uploads queued, its loads
        counted): flush soon, so the scheduler side learns it."""
        self._step = step
        self.flush_soon()

    def flush_soon(self) -> None:
        """Flush on the loop as soon as it runs, or ``_SOON_GAP_S`` after the last
        flush; at most one such flush is queued at a time. Callers: a marked step, the
        publisher once idle."""
        loop = self._loop
        if loop is None or self._flush_posted:
            return
        self._flush_posted = True

        def run() -> None:
            wait = self._last_flush + _SOON_GAP_S - time.monotonic()
            if wait > 0:
                loop.loop.call_later(wait, run)
                return
            self._flush_posted = False
            try:
                self.flush(force=True)
            except Exception as exc:  # noqa: BLE001 - metrics must never stop the loop
                logger.debug("ec-s3: flushing worker stats failed: %s", exc)

        try:
            loop.call_soon(run)
        except RuntimeError:  # the loop is gone (shutdown): close() flushes
            self._flush_posted = False

    def flush_periodically(self, loop: BackgroundLoop, every_s: float = 0.5) -> None:
        """Flush from ``loop`` every ``every_s`` until closed: uploads finish on the I/O
        loop after the step that queued them, possibly with no step after them."""
        self._loop = loop

        async def run() -> None:
            while not self._closed:
                await asyncio.sleep(every_s)
                try:
                    self.flush(force=True)
                except Exception as exc:  # noqa: BLE001 - metrics must never stop the loop
                    logger.debug("ec-s3: flushing worker stats failed: %s", exc)

        loop.submit(run())

    def close(self) -> None:
        """Flush and release the lock; the reader counts this last snapshot, then removes
        the file (a writer cannot know when that happened)."""
        with contextlib.suppress(Exception):
            self.flush(force=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
            os.close(self._fd)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What the reader has seen of its engine's writers: the lowest step they marked
    and their uploads in flight, as of their last snapshots it collected, and how many
    writers it reads, as of its ``collections``-th collection."""

    step: int = 0
    uploads_pending: int = 0
    writers: int = 0
    collections: int = 0


class SharedStatsReader:
    """The scheduler side: increments of every live writer of one engine.

    :meth:`collect` does the file-system work (list the directory, map new files, read
    those whose sequence moved, remove dead writers' files) and queues one ready delta;
    it runs on the I/O loop (:meth:`collect_periodically`), never on the engine thread.
    :meth:`take_delta` only pops the deltas queued since the previous call, so vLLM's
    per-step stats call never touches a file, waits for a writer or takes a lock that
    the loop thread holds. A writer whose file vanished (closed) keeps what it already
    reported; a dead writer's leftover file is counted once more, then removed.
    """

    def __init__(self, directory: str, engine_id: str) -> None:
        self._dir = Path(directory)
        self._prefix = stats_file_prefix(engine_id)
        self._files: dict[str, _MappedStats] = {}
        self._ready: collections.deque[dict[str, Any]] = collections.deque()  # append/popleft: atomic
        self._lock = threading.Lock()  # collect vs close; never taken by take_delta
        self._closed = False
        self._future: Any = None
        # Published after the delta of the same collection is queued: whoever sees a
        # progress sees (or has taken) the counts that came with it.
        self._progress = Progress()
        self._hurry_until = 0.0
        self._wake: Callable[[], None] | None = None

    @property
    def progress(self) -> Progress:
        return self._progress

    def undelivered(self) -> bool:
        """A collected delta waits for :meth:`take_delta` (lock-free)."""
        return bool(self._ready)

    def hurry(self, for_s: float) -> None:
        """Collect every ``_HURRY_EVERY_S`` for the next ``for_s`` seconds, starting
        now (the engine thread calls this; it only sets a deadline, and wakes the loop
        once when it was not hurrying already)."""
        now = time.monotonic()
        was = self._hurry_until > now
        self._hurry_until = now + for_s
        if not was and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                self._wake()

    def take_delta(self) -> dict[str, Any]:
        out: dict[str, Any] = _empty_delta()
        while self._ready:
            delta = self._ready.popleft()
            for name, inc in delta["counters"].items():
                out["counters"][name] = out["counters"].get(name, 0.0) + inc
            out["gauges"] = delta["gauges"]  # the latest values win
            for name, values in delta["samples"].items():
                out["samples"].setdefault(name, []).extend(values)
        return out

    def collect(self) -> None:
        """Read every file whose sequence moved since the last collection and queue
        their increments as one delta; a writer caught mid-update is read next time."""
        with self._lock:
            if self._closed:
                return
            self._scan()
            delta = _empty_delta()
            for name, mapped in list(self._files.items()):
                alive = mapped.writer_alive()  # before the read: a last flush is never missed
                snapshot = mapped.read_if_moved()
                if snapshot is not None:
                    mapped.account(snapshot, delta)
                if not alive:
                    mapped.close()
                    del self._files[name]
                    with contextlib.suppress(OSError):
                        (self._dir / name).unlink()
            if delta["counters"] or delta["samples"]:
                gauges: dict[str, float] = {}
                for mapped in self._files.values():
                    for key, value in mapped.gauges.items():
                        gauges[key] = gauges.get(key, 0.0) + value
                delta["gauges"] = gauges
                self._ready.append(delta)
            # After the append (see __init__). Several writers of one engine: the step
            # all of them have reached, and all their uploads.
            live = [mapped.progress for mapped in self._files.values()]
            self._progress = Progress(
                step=min((p.step for p in live), default=0),
                uploads_pending=sum(p.uploads_pending for p in live),
                writers=len(live),
                collections=self._progress.collections + 1,
            )

    def _scan(self) -> None:
        """Map this engine's files that appeared since the last scan (the directory
        holds stats files only, so the listing stays short)."""
        try:
            names = [e.name for e in os.scandir(self._dir) if e.name.startswith(self._prefix)]
        except OSError:
            return
        for name in names:
            if name not in self._files:
                mapped = _MappedStats.open(self._dir / name)
                if mapped is not None:
                    self._files[name] = mapped

    def collect_periodically(self, loop: BackgroundLoop, every_s: float = _COLLECT_EVERY_S) -> None:
        """Collect on ``loop`` every ``every_s`` until :meth:`close`."""

        woken = asyncio.Event()  # loop-free until first awaited (Python >= 3.10)

        async def run() -> None:
            while not self._closed:
                try:
                    self.collect()
                except Exception as exc:  # noqa: BLE001 - metrics must never stop the loop
                    logger.debug("ec-s3: collecting worker stats failed: %s", exc)
                woken.clear()
                pause = _HURRY_EVERY_S if self._hurry_until > time.monotonic() else every_s
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), pause)

        self._wake = lambda: loop.call_soon(woken.set)
        self._future = loop.submit(run())

    def close(self) -> None:
        """Stop collecting, unmap every file and remove those of dead writers."""
        if self._future is not None:
            self._future.cancel()
        with self._lock:
            self._closed = True
            for mapped in self._files.values():
                mapped.close()
            self._files.clear()
        self.remove_dead()

    def remove_dead(self) -> int:
        """Remove files whose writer is gone (their lock can be taken); returns how many."""
        removed = 0
        try:
            paths = [p for p in self._dir.iterdir() if p.name.startswith("ec-s3-stats-")]
        except OSError:
            return 0
        for path in paths:
            if not _locked(path):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed


def _empty_delta() -> dict[str, Any]:
    return {"counters": {}, "gauges": {}, "samples": {}}


class _MappedStats:
    """One writer's file, kept open and mapped for as long as its writer lives, with
    what the reader has already counted from it."""

    def __init__(self, fd: int, view: mmap.mmap) -> None:
        self._fd = fd
        self._view = view
        self._seq = 0
        self._seen_counters: dict[str, float] = {}
        self._seen_samples: dict[str, int] = {}
        self.gauges: dict[str, float] = {}
        self.progress = Progress()

    @classmethod
    def open(cls, path: Path) -> _MappedStats | None:
        """None while the file is not ready (its writer is still sizing it) or unreadable."""
        try:
            fd = open_nofollow(path)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size >= _SIZE:
                return cls(fd, mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:
            logger.debug("ec-s3: cannot map worker stats %s: %s", path, exc)
        os.close(fd)
        return None

    def writer_alive(self) -> bool:
        """True while the writer holds its lock (probed on our own open file: a shared
        lock conflicts with the writer's exclusive one, in this process too)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def read_if_moved(self) -> dict[str, Any] | None:
        """The snapshot if the sequence moved to a new consistent value; None when it
        did not, or the writer is mid-update (no waiting: the next collection reads it)."""
        seq, length = _HEADER.unpack_from(self._view, 0)
        if seq == self._seq or seq % 2 or not seq:
            return None
        payload = bytes(self._view[_HEADER.size : _HEADER.size + min(length, _SIZE - _HEADER.size)])
        if _HEADER.unpack_from(self._view, 0)[0] != seq:
            return None
        self._seq = seq
        try:
            data = json.loads(payload)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def account(self, snapshot: dict[str, Any], delta: dict[str, Any]) -> None:
        """Add ``snapshot``'s increments since the last one to ``delta``."""
        counters, samples = delta["counters"], delta["samples"]
        for name, value in snapshot.get("counters", {}).items():
            inc = float(value) - self._seen_counters.get(name, 0.0)
            if inc:
                counters[name] = counters.get(name, 0.0) + inc
                self._seen_counters[name] = float(value)
        self.gauges = {name: float(value) for name, value in snapshot.get("gauges", {}).items()}
        progress = snapshot.get("progress") or {}
        self.progress = Progress(int(progress.get("step", 0)), int(progress.get("uploads_pending", 0)))
        for name, total in snapshot.get("sample_counts", {}).items():
            new = int(total) - self._seen_samples.get(name, 0)
            if new > 0:
                kept = snapshot.get("samples", {}).get(name, [])
                samples.setdefault(name, []).extend(float(v) for v in kept[-new:])
                self._seen_samples[name] = int(total)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._view.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _locked(path: Path) -> bool:
    """True while a live writer holds ``path``'s lock."""
    try:
        fd = open_nofollow(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops our probe lock with it
    return False
