"""Host staging area shared between the scheduler process and its workers.

The scheduler side downloads a blob into a file on tmpfs and validates it there;
workers on the host map that file. Owns slot files (reserved before written, named per
generation, kept open as a handle), their byte bound, LRU eviction of unpinned slots and
their lifetimes, and each process's owned directory. Does not own what goes into a slot
(the fetcher), which requests need it (the scheduler) or reading a slot on the worker
side (:mod:`ec_s3.transfer.slot_reader`). Details: docs/architecture.md.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import mmap
import os
import re
import resource
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path

from ec_s3.log import logger
from ec_s3.transfer.fsutil import UnsafeDirectory, create_exclusive, ensure_private_dir, open_nofollow

__all__ = ["NoStagingSpace", "StagingArea", "StagingSlot", "map_handle", "map_slot", "slot_fd_budget"]

_DIR_PREFIX = "ec-s3-"
_LOCK_NAME = ".owner.lock"
# Steps a slot survives after it was last sent to workers in connector metadata.
_UNLINK_GRACE_STEPS = 3
# Slot names become file names: keep them to one harmless path component.
_SLOT_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Errors of a reservation that mean "the file system is full", not "something broke".
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NO_SPACE_LOG_EVERY_S = 60.0
# Open slot files may take at most this share of the soft RLIMIT_NOFILE, and never more
# than _MAX_HELD_FDS: the engine's sockets, ZMQ and shared memory need the rest.
_FD_SHARE = 4
_MAX_HELD_FDS = 4096


class NoStagingSpace(Exception):
    """The staging file system has no room for a slot (ENOSPC, EDQUOT or EFBIG).

    Unlike ``allocate`` returning None (``staging_bytes`` is held by pinned slots),
    this is the host running out of shared memory below ``staging_bytes``.
    """

    def __init__(self, path: str, nbytes: int, code: int) -> None:
        super().__init__(f"no room for {nbytes} bytes in {path}: {os.strerror(code)}")
        self.path, self.nbytes, self.code = path, nbytes, code


@dataclasses.dataclass(eq=False)
class StagingSlot:
    """One slot: a staging file of exactly ``nbytes`` bytes for one blob (staged once ``ready``).

    Compared by identity: two generations of one name are different slots.
    """

    name: str
    path: str
    nbytes: int
    generation: int = 0
    pins: int = 0
    last_dispatch_step: int = -1_000_000
    # Step in which the scheduler last told vLLM this slot is a hit: it must
    # survive until the load is dispatched in that step's metadata.
    touched_step: int = -1_000_000
    ready: bool = False
    evicted: bool = False
    # The open file (kept while the area holds it, -1 otherwise) and its identity.
    fd: int = -1
    inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino); (0, 0) before the file exists

    @property
    def handle(self) -> str:
        """``/proc/<pid>/fd/<n>``: the file itself for any process of this host's PID
        namespace, even once its name is gone; "" when the area keeps no descriptor."""
        return f"/proc/{os.getpid()}/fd/{self.fd}" if self.fd >= 0 else ""


class StagingArea:
    """Byte-bounded set of staged blobs in one per-process directory.

    Used from two threads: the I/O loop allocates slots (downloads land in them),
    the scheduler thread pins, dispatches and steps. A lock guards the bookkeeping;
    file contents are written only by the download that owns the slot.
    """

    def __init__(self, root: str, capacity_bytes: int, fd_budget: int | None = None) -> None:
        self.capacity = capacity_bytes
        self.fd_budget = slot_fd_budget() if fd_budget is None else fd_budget
        self.held_fds = 0
        base = ensure_private_dir(root, key="staging_dir", shared_ok=True)
        _remove_orphaned_dirs(base)
        self.dir, self._owner_fd = _create_owned_dir(base)
        self._slots: collections.OrderedDict[str, StagingSlot] = collections.OrderedDict()
        self._doomed: list[StagingSlot] = []
        self.used = 0
        self.step = 0
        self._generation = 0
        self._no_space_logged_at = -_NO_SPACE_LOG_EVERY_S
        self._lock = threading.RLock()
        _warn_if_too_small(self.dir, capacity_bytes)

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

        Returns None when pinned slots hold the space: the caller retries later.
        Raises :class:`NoStagingSpace` when the file system itself is full, and any
        other ``OSError`` of creating the file; either way nothing stays booked.
        The bookkeeping happens under the lock, the file system calls after it, so
        the scheduler thread never waits on a syscall the I/O thread is making.
        """
        if not _SLOT_NAME_RE.fullmatch(name):
            raise ValueError(f"slot name {name!r} is not 1-128 of [A-Za-z0-9_-]")
        with self._lock:
            if name in self._slots:
                raise ValueError(f"slot {name} already exists")
            if nbytes > self.capacity:
                return None
            victims: list[tuple[StagingSlot, bool]] = []
            if self.used + nbytes > self.capacity:
                for victim in [s for s in self._slots.values() if self._evictable(s)]:
                    victims.append(self._evict(victim))
                    if self.used + nbytes <= self.capacity:
                        break
            if self.used + nbytes > self.capacity:
                self._finish_evictions(victims)
                return None
            self._generation += 1
            slot = StagingSlot(
                name=name, path=str(self.dir / f"{name}.{self._generation}.blob"), nbytes=nbytes,
                generation=self._generation,
            )
            self._slots[name] = slot
            self.used += nbytes
        try:
            self._finish_evictions(victims)
            self._create_file(slot)
        except BaseException:
            self._rollback(slot)
            raise
        return slot

    def _create_file(self, slot: StagingSlot) -> None:
        fd = create_exclusive(slot.path)
        try:
            if slot.nbytes:
                # Reserve every page now; writing an unreserved page of a full tmpfs
                # through mmap is a SIGBUS, not an error.
                os.posix_fallocate(fd, 0, slot.nbytes)
            st = os.fstat(fd)
        except BaseException as exc:
            os.close(fd)
            _unlink(slot.path)
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE_ERRNOS:
                self._log_no_space(slot.nbytes)
                raise NoStagingSpace(str(self.dir), slot.nbytes, exc.errno) from exc
            raise
        with self._lock:
            slot.inode = (st.st_dev, st.st_ino)
            if not slot.evicted and self.held_fds < self.fd_budget:
                slot.fd, fd = fd, -1
                self.held_fds += 1
        if fd >= 0:
            os.close(fd)

    def map(self, slot: StagingSlot, writable: bool = False) -> mmap.mmap:
        """Map ``slot``'s file: through the descriptor the area holds when it has one
        (its name may be gone), else by path."""
        with self._lock:
            # A duplicate under the lock: the scheduler thread may release the slot
            # (closing its descriptor, whose number the next open reuses) meanwhile.
            fd = os.dup(slot.fd) if slot.fd >= 0 else -1
        if fd < 0:
            return map_slot(slot.path, writable)
        try:
            return _map_fd(fd, slot.path, writable)
        finally:
            os.close(fd)

    def _release(self, slot: StagingSlot) -> None:
        """Remove ``slot``'s file and close the descriptor the area held for it."""
        with self._lock:
            fd, slot.fd = slot.fd, -1
            if fd >= 0:
                self.held_fds -= 1
        _unlink(slot.path)
        if fd >= 0:
            os.close(fd)

    def _rollback(self, slot: StagingSlot) -> None:
        with self._lock:
            if self._slots.get(slot.name) is slot:
                del self._slots[slot.name]
                self.used -= slot.nbytes
            slot.evicted = True
        self._release(slot)

    def _log_no_space(self, nbytes: int) -> None:
        now = time.monotonic()
        if now - self._no_space_logged_at < _NO_SPACE_LOG_EVERY_S:
            return
        self._no_space_logged_at = now
        logger.warning(
            "ec-s3: staging_dir %s is full (no room for %d bytes, %d of staging_bytes=%d in use by ec-s3): "
            "items are encoded locally instead. Give the host or container more shared memory "
            "(docker --shm-size / compose shm_size, or a larger host /dev/shm with ipc: host) or lower staging_bytes.",
            self.dir.parent, nbytes, self.used, self.capacity,
        )

    def _evictable(self, slot: StagingSlot) -> bool:
        return slot.ready and slot.pins == 0 and slot.touched_step < self.step

    def discard(self, slot: StagingSlot | str) -> None:
        """Drop a slot now (failed or invalid download: nobody was handed it).

        Given a slot, only that generation is dropped; given a name, whichever
        generation holds it now.
        """
        with self._lock:
            name = slot if isinstance(slot, str) else slot.name
            current = self._slots.get(name)
            if current is None or (isinstance(slot, StagingSlot) and current is not slot):
                return
            del self._slots[name]
            current.evicted = True
            self.used -= current.nbytes
        self._release(current)

    def slots(self) -> list[StagingSlot]:
        """The live slots (a copy), for invariant checks."""
        with self._lock:
            return list(self._slots.values())

    def violations(self) -> list[str]:
        """Broken rules of the bookkeeping: bytes in use are the live slots' bytes; no
        live slot is marked evicted; no evicted slot is pinned."""
        with self._lock:
            out = []
            live = sum(s.nbytes for s in self._slots.values())
            if live != self.used:
                out.append(f"staging books {self.used} bytes in use, its live slots hold {live}")
            out += [f"slot {s.name} is live but marked evicted" for s in self._slots.values() if s.evicted]
            out += [f"evicted slot {s.name} is pinned {s.pins} times" for s in self._doomed if s.pins]
            return out

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
            self._release(slot)

    def _evict(self, slot: StagingSlot) -> tuple[StagingSlot, bool]:
        """Take ``slot`` out (lock held). Returns it and whether to unlink it now; a
        slot dispatched recently stays on disk (a worker may still open it) until
        :meth:`advance_step` ends its grace. Its path is its own, so the name can be
        staged again at once without touching it."""
        slot.evicted = True
        self._slots.pop(slot.name, None)
        self.used -= slot.nbytes
        if self.step - slot.last_dispatch_step > _UNLINK_GRACE_STEPS:
            return slot, True
        self._doomed.append(slot)
        return slot, False

    def _finish_evictions(self, victims: list[tuple[StagingSlot, bool]]) -> None:
        for slot, unlink_now in victims:
            if unlink_now:
                self._release(slot)

    def close(self) -> None:
        with self._lock:
            shutil.rmtree(self.dir, ignore_errors=True)
            for slot in [*self._slots.values(), *self._doomed]:
                if slot.fd >= 0:
                    os.close(slot.fd)
                    slot.fd = -1
            self.held_fds = 0
            self._slots.clear()
            self._doomed.clear()
            self.used = 0
            if self._owner_fd >= 0:
                os.close(self._owner_fd)
                self._owner_fd = -1


def map_slot(path: str, writable: bool = False, inode: tuple[int, int] = (0, 0)) -> mmap.mmap:
    """Map a slot's file, unchecked (never through a symlink). Copy-on-write when read-only, so
    torch can view it without a read-only-buffer warning and without ever writing
    back to the shared file. A known ``inode`` (not ``(0, 0)``) must be the file's."""
    fd = open_nofollow(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return _map_fd(fd, path, writable, inode)
    finally:
        os.close(fd)


def map_handle(handle: str, inode: tuple[int, int]) -> mmap.mmap:
    """Map, read-only, the slot file a scheduler holds open as ``handle``
    (``/proc/<pid>/fd/<n>``), checking it is still the file of ``inode``: the number
    is reused for another file once the scheduler closes it. (A disk file system may
    reuse the inode number too, tmpfs practically never; the caller's header check
    still refuses any other blob.)"""
    if not handle.startswith("/proc/") or inode == (0, 0):
        raise OSError(errno.EINVAL, "not a slot handle", handle)
    # A magic link, followed on purpose (O_NOFOLLOW refuses it); the inode is the check.
    fd = os.open(handle, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _map_fd(fd, handle, False, inode)
    finally:
        os.close(fd)


def _map_fd(fd: int, name: str, writable: bool, inode: tuple[int, int] = (0, 0)) -> mmap.mmap:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", name)
    if inode != (0, 0) and (st.st_dev, st.st_ino) != inode:
        raise OSError(errno.ESTALE, "another file than the staged slot", name)
    access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY
    return mmap.mmap(fd, st.st_size, access=access)


def slot_fd_budget() -> int:
    """How many slot files an area keeps open: a quarter of the soft ``RLIMIT_NOFILE``
    (vLLM raises it at start), at most 4096."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return _MAX_HELD_FDS
    return max(0, min(_MAX_HELD_FDS, soft // _FD_SHARE))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the bytes stay booked elsewhere only until the dir goes
        logger.warning("ec-s3: cannot remove staging file %s: %s", path, exc)


def _create_owned_dir(base: Path) -> tuple[Path, int]:
    """Make this process's directory and take its owner lock (kept until exit)."""
    path = base / f"{_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(path, 0o700)
        fd = create_exclusive(path / _LOCK_NAME)
    except OSError as exc:
        raise UnsafeDirectory("staging_dir", str(base), f"does not let this user create {path.name} ({exc.strerror})") from exc
    # Never blocks: nobody else knows the directory yet. Without the lock a clean-up
    # could take the directory for a dead one between mkdir and here; it finds no
    # lock file then and leaves the directory alone.
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, fd


def _remove_orphaned_dirs(base: Path) -> None:
    """Remove staging directories of this user whose owner lock is free (owner dead)."""
    me = os.geteuid()
    try:
        entries = list(os.scandir(base))
    except OSError as exc:
        logger.warning("ec-s3: cannot list staging_dir %s for leftovers: %s", base, exc)
        return
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            continue  # another user's, or not a directory: not ours to judge
        try:
            fd = open_nofollow(os.path.join(entry.path, _LOCK_NAME))
        except FileNotFoundError:
            # Being created right now, or left by an ec-s3 without owner locks.
            logger.info("ec-s3: leaving %s in staging_dir: it has no owner lock (remove it by hand if "
                        "no ec-s3 process uses it)", entry.path)
            continue
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live owner, possibly in another PID namespace
            logger.info("ec-s3: removing staging left by a process that exited: %s", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _warn_if_too_small(directory: Path, capacity: int) -> None:
    """Say at start-up, not at the first full tmpfs, that staging_bytes cannot fit."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < capacity:
        logger.warning(
            "ec-s3: staging_dir %s has %d bytes free but staging_bytes=%d: downloads that do not fit will be "
            "skipped and their items encoded locally. Give the host or container more shared memory "
            "(docker --shm-size / compose shm_size, or a larger host /dev/shm with ipc: host) or lower staging_bytes.",
            directory.parent, free, capacity,
        )
