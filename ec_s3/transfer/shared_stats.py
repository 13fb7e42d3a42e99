"""Worker counters made visible to the scheduler process through shared memory.

vLLM's multiprocess executor never collects worker-side connector stats on the V1
model runner, and an encoder-only producer drops its worker metadata, so uploads,
upload failures and loads counted in a worker would never reach ``/metrics``. Each
publishing worker therefore mirrors its :class:`~ec_s3.transfer.counters.Counters` into
a small file on tmpfs named after the engine (``ec_transfer_config.engine_id``, the same
in the scheduler and its workers); the scheduler-side connector reads every such file
of its engine and reports the increments as its own.

The file is one snapshot (cumulative counters, current gauges, the latest latency
samples with their running count) as JSON under a sequence lock: the writer bumps the
sequence to odd, writes, bumps it to even; a reader retries while the sequence is odd
or changed under it. One writer per file, any number of readers, no cross-process lock.
The writer holds an ``flock`` on its file for its lifetime, so a reader can tell a dead
writer's leftover (lock free) and remove it.

Owns the file format, the writer's throttled flushes and the reader's deltas. Does not
own what the counters mean (``ec_s3.connector.metrics``) or when vLLM asks for stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import mmap
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

from ec_s3.log import logger
from ec_s3.loop import BackgroundLoop
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.fsutil import create_exclusive, open_nofollow

__all__ = ["SharedStatsReader", "SharedStatsWriter", "stats_file_prefix"]

_SIZE = 256 * 1024
_HEADER = struct.Struct("<QI")  # sequence, payload length
_SAMPLES_KEPT = 512  # per histogram in the snapshot; the reader takes only the new ones
_FLUSH_EVERY_S = 0.25
_READ_ATTEMPTS = 20
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


def stats_file_prefix(engine_id: str) -> str:
    return f"ec-s3-stats-{_SAFE_ID.sub('_', engine_id)[:64]}-"


class SharedStatsWriter:
    """Mirrors one process's counters into ``<dir>/ec-s3-stats-<engine>-<pid>``.

    :meth:`flush` writes at most every ``_FLUSH_EVERY_S`` unless forced; callers flush
    from wherever counters move (the step, the I/O loop) and once, forced, at close.
    """

    def __init__(self, directory: str, engine_id: str, counters: Counters) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {}
        self._sample_counts: dict[str, int] = {}
        self._last_flush = 0.0
        self._seq = 0
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

    def flush_periodically(self, loop: BackgroundLoop, every_s: float = 0.5) -> None:
        """Flush from ``loop`` every ``every_s`` until closed: uploads finish on the I/O
        loop after the step that queued them, possibly with no step after them."""

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


class SharedStatsReader:
    """The scheduler side: increments of every live writer of one engine since the
    previous :meth:`take_delta`. A writer whose file vanished (closed) keeps what it
    already reported; a dead writer's leftover file is removed."""

    def __init__(self, directory: str, engine_id: str) -> None:
        self._dir = Path(directory)
        self._prefix = stats_file_prefix(engine_id)
        self._seen_counters: dict[str, dict[str, float]] = {}
        self._seen_samples: dict[str, dict[str, int]] = {}

    def take_delta(self) -> dict[str, Any]:
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        samples: dict[str, list[float]] = {}
        try:
            paths = [p for p in self._dir.iterdir() if p.name.startswith(self._prefix)]
        except OSError:
            return {"counters": counters, "gauges": gauges, "samples": samples}
        for path in paths:
            snapshot = _read(path)
            if snapshot is None:
                continue
            if not _locked(path):  # its writer closed or died: this was its last word
                with contextlib.suppress(OSError):
                    path.unlink()
            seen = self._seen_counters.setdefault(path.name, {})
            for name, value in snapshot.get("counters", {}).items():
                inc = float(value) - seen.get(name, 0.0)
                if inc:
                    counters[name] = counters.get(name, 0.0) + inc
                    seen[name] = float(value)
            for name, value in snapshot.get("gauges", {}).items():
                gauges[name] = gauges.get(name, 0.0) + float(value)
            seen_counts = self._seen_samples.setdefault(path.name, {})
            for name, total in snapshot.get("sample_counts", {}).items():
                new = int(total) - seen_counts.get(name, 0)
                if new > 0:
                    kept = snapshot.get("samples", {}).get(name, [])
                    samples.setdefault(name, []).extend(float(v) for v in kept[-new:])
                    seen_counts[name] = int(total)
        return {"counters": counters, "gauges": gauges, "samples": samples}

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


def _read(path: Path) -> dict[str, Any] | None:
    try:
        fd = open_nofollow(path)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < _SIZE:
            return None
        with mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ) as view:
            for _ in range(_READ_ATTEMPTS):
                seq, length = _HEADER.unpack_from(view, 0)
                if seq % 2 or not seq:
                    time.sleep(0)
                    continue
                payload = bytes(view[_HEADER.size : _HEADER.size + min(length, _SIZE - _HEADER.size)])
                if _HEADER.unpack_from(view, 0)[0] != seq:
                    continue
                try:
                    data = json.loads(payload)
                except ValueError:
                    return None
                return data if isinstance(data, dict) else None
    except (OSError, ValueError) as exc:
        logger.debug("ec-s3: cannot read worker stats %s: %s", path, exc)
    finally:
        os.close(fd)
    return None
