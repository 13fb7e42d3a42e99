"""Host staging area shared between the scheduler process and its workers.

The scheduler side downloads a blob straight into a file on tmpfs (``/dev/shm``) and
validates it there; workers on the same host map the same file and copy the tensor
to their device. One download serves every TP rank, the model step never touches
the network, and the bytes are copied once from the socket to their final place.

The area is bounded in bytes. A slot is pinned while a request needs it; unpinned
slots stay as a cache and are evicted least-recently-used when space is needed. A
slot is unlinked only a few engine steps after it was last handed to workers, so a
step already dispatched (async scheduling) can still open it. Directories left by a
crashed process (dead pid) are removed at start-up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import os
import secrets
import shutil
import threading
from pathlib import Path

from ec_s3.log import logger

__all__ = ["StagingArea", "StagingSlot", "open_slot_view"]

_DIR_PREFIX = "ec-s3-"
# Steps a slot survives after it was last sent to workers in connector metadata.
_UNLINK_GRACE_STEPS = 3


@dataclasses.dataclass
class StagingSlot:
    """One staged blob: a file of exactly ``nbytes`` bytes."""

    name: str
    path: str
    nbytes: int
    pins: int = 0
    last_dispatch_step: int = -1_000_000
    # Step in which the scheduler last told vLLM this slot is a hit: it must
    # survive until the load is dispatched in that step's metadata.
    touched_step: int = -1_000_000
    ready: bool = False
    evicted: bool = False


class StagingArea:
    """Byte-bounded set of staged blobs in one per-process directory.

    Used from two threads: the I/O loop allocates slots (downloads land in them),
    the scheduler thread pins, dispatches and steps. A lock guards the bookkeeping;
    file contents are written only by the download that owns the slot.
    """

    def __init__(self, root: str, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        _remove_dead_dirs(base)
        self.dir = base / f"{_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.dir.mkdir(mode=0o700)
        self._slots: collections.OrderedDict[str, StagingSlot] = collections.OrderedDict()
        self._doomed: list[StagingSlot] = []
        self.used = 0
        self.step = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, name: str) -> StagingSlot | None:
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None:
                self._slots.move_to_end(name)
            return slot

    def allocate(self, name: str, nbytes: int) -> StagingSlot | None:
        """Reserve ``nbytes`` for a new slot, evicting unpinned slots if needed.

        Returns None when pinned slots hold the space: the caller retries later. The
        bookkeeping happens under the lock, the file system calls after it, so the
        scheduler thread never waits on a syscall the I/O thread is making.
        """
        with self._lock:
            if name in self._slots:
                raise ValueError(f"slot {name} already exists")
            if nbytes > self.capacity:
                return None
            victims: list[tuple[StagingSlot, str | None]] = []
            if self.used + nbytes > self.capacity:
                for victim in [s for s in self._slots.values() if self._evictable(s)]:
                    victims.append(self._evict(victim))
                    if self.used + nbytes <= self.capacity:
                        break
            if self.used + nbytes > self.capacity:
                self._finish_evictions(victims)
                return None
            slot = StagingSlot(name=name, path=str(self.dir / f"{name}.blob"), nbytes=nbytes)
            self._slots[name] = slot
            self.used += nbytes
        self._finish_evictions(victims)
        fd = os.open(slot.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return slot

    def _evictable(self, slot: StagingSlot) -> bool:
        return slot.ready and slot.pins == 0 and slot.touched_step < self.step

    def discard(self, name: str) -> None:
        """Drop a slot now (failed or invalid download: nobody was handed it)."""
        with self._lock:
            slot = self._slots.pop(name, None)
            if slot is None:
                return
            slot.evicted = True
            self.used -= slot.nbytes
        _unlink(slot.path)

    def mark_ready(self, slot: StagingSlot) -> None:
        with self._lock:
            slot.ready = True

    def pin(self, slot: StagingSlot) -> bool:
        """Keep ``slot`` until :meth:`unpin`; False if it was already evicted."""
        with self._lock:
            if slot.evicted:
                return False
            slot.pins += 1
            return True

    def unpin(self, slot: StagingSlot) -> None:
        with self._lock:
            slot.pins = max(0, slot.pins - 1)

    def touch(self, slot: StagingSlot) -> bool:
        """Protect ``slot`` from eviction for the rest of this step; False if gone."""
        with self._lock:
            if slot.evicted:
                return False
            slot.touched_step = self.step
            return True

    def mark_dispatched(self, slot: StagingSlot) -> None:
        with self._lock:
            slot.last_dispatch_step = self.step

    def advance_step(self) -> None:
        """Called once per engine step: unlink evicted slots past their grace."""
        with self._lock:
            self.step += 1
            expired = [s for s in self._doomed if self.step - s.last_dispatch_step > _UNLINK_GRACE_STEPS]
            if not expired:
                return
            self._doomed = [s for s in self._doomed if s not in expired]
        for slot in expired:
            _unlink(slot.path)

    def _evict(self, slot: StagingSlot) -> tuple[StagingSlot, str | None]:
        """Take ``slot`` out (lock held). Returns it with the path to rename it to if a
        worker may still open it (dispatched recently), else None (unlink it)."""
        slot.evicted = True
        self._slots.pop(slot.name, None)
        self.used -= slot.nbytes
        if self.step - slot.last_dispatch_step > _UNLINK_GRACE_STEPS:
            return slot, None
        # Renamed out of the way so the name can be staged again at once.
        doomed = dataclasses.replace(slot, path=f"{slot.path}.evicted-{self.step}")
        self._doomed.append(doomed)
        return slot, doomed.path

    @staticmethod
    def _finish_evictions(victims: list[tuple[StagingSlot, str | None]]) -> None:
        for slot, rename_to in victims:
            if rename_to is None:
                _unlink(slot.path)
            else:
                with contextlib.suppress(OSError):
                    os.rename(slot.path, rename_to)

    def close(self) -> None:
        with self._lock:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._slots.clear()
            self._doomed.clear()
            self.used = 0


def open_slot_view(path: str, writable: bool = False) -> mmap.mmap:
    """Map a slot file. Copy-on-write when read-only, so torch can view it without a
    read-only-buffer warning and without ever writing back to the shared file."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
        return mmap.mmap(fd, size, access=access)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_dead_dirs(base: Path) -> None:
    for entry in base.glob(f"{_DIR_PREFIX}*"):
        try:
            pid = int(entry.name[len(_DIR_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            logger.info("ec-s3: removing staging left by dead process %d: %s", pid, entry)
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
