"""Producer outage spool: blobs whose upload failed wait on local disk for the store.

Owns the spool directory's files (written exclusively, fsynced and renamed; named
``<time_ns>-<sha256(key)[:32]>-<random>.blob`` with the key in a small header), their
byte bound, and the background re-upload, oldest first, that resumes what an earlier
process left. A file that fails any check is renamed ``.rejected``, never uploaded.
Does not own when to spool (the publisher) or retries of one request (the store).
Details: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ec_s3.log import logger
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.fsutil import create_exclusive, ensure_private_dir, open_nofollow
from ec_s3.store.client import Body, BufferChain, PutOutcome, S3Store, StoreError, StoreUnavailable

__all__ = ["Spool"]

_SUFFIX = ".blob"
_REJECTED = ".rejected"
_MAGIC = b"EC-S3-SPOOL\x01"
_KEY_LEN = struct.Struct("<H")
_MAX_KEY_BYTES = 1024  # S3's own limit
_DIGEST_CHARS = 32
# A file whose upload raised something unexpected this many times is set aside, so
# one bad file cannot hold the queue behind it forever.
_MAX_STRIKES = 3
_MAX_BACKOFF_S = 60.0


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]


def _name_for(key: str) -> str:
    return f"{time.time_ns():020d}-{_digest(key)}-{secrets.token_hex(4)}{_SUFFIX}"


def _header_for(key: str) -> bytes:
    raw = key.encode("utf-8")
    return _MAGIC + _KEY_LEN.pack(len(raw)) + raw


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str
    buf: bytearray
    offset: int  # where the blob starts in buf


@dataclasses.dataclass(frozen=True)
class _Rejected:
    reason: str


class Spool:
    def __init__(
        self, directory: str, max_bytes: int, retry_s: float, store: S3Store, counters: Counters, *,
        owns: Callable[[str], bool],
    ) -> None:
        self.dir = ensure_private_dir(directory, key="spool_dir")
        self.max_bytes = max_bytes
        self.retry_s = retry_s
        self._store = store
        self._counters = counters
        self._owns = owns
        # Taken by the loop and by writer threads; held for dict updates only.
        self._mu = threading.Lock()
        self._sizes: dict[str, int] = {}  # spool files we account for -> bytes
        self._reserved = 0  # bytes of saves being written
        self._strikes: dict[str, int] = {}
        self._ignored: set[str] = set()  # could not be set aside: skip, logged once
        self._seen_unexpected: set[type[BaseException]] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.endswith(".tmp") and stat.S_ISREG(st.st_mode):  # torn writes of a crashed process
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            elif entry.name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode):
                self._sizes[entry.name] = st.st_size
        self._update_gauges()

    @property
    def used(self) -> int:
        with self._mu:
            return sum(self._sizes.values()) + self._reserved

    def _update_gauges(self) -> None:
        self._counters.set_gauge("spool_bytes", self.used)
        self._counters.set_gauge("spool_blobs", len(self.pending()))

    def pending(self) -> list[Path]:
        return sorted(p for p in self.dir.glob(f"*{_SUFFIX}") if p.name not in self._ignored)

    def start(self) -> None:
        """Start the re-upload task on the store's loop (resumes earlier leftovers)."""
        self._store.background.call_soon(self._start_on_loop)

    def _start_on_loop(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.ensure_future(self._drain_forever())
            if self.used:
                logger.info("ec-s3: spool %s holds %d bytes from earlier; re-uploading", self.dir, self.used)
                self._wake.set()

    # ------------------------------------------------------------------ writing
    async def save(self, key: str, body: Body) -> bool:
        """Write ``body`` to the spool; False (and counted) if it is full or cannot."""
        if not self._owns(key) or len(key.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
            self._counters.inc("spool_rejected")
            logger.warning("ec-s3: not spooling %r: not a key of this producer", key[:200])
            return False
        header = _header_for(key)
        chain = body if isinstance(body, BufferChain) else BufferChain([body])
        size = len(header) + len(chain)
        with self._mu:
            if sum(self._sizes.values()) + self._reserved + size > self.max_bytes:
                self._counters.inc("spool_full_drops")
                return False
            self._reserved += size
        # The thread settles the reservation itself, so a cancelled caller (shutdown)
        # cannot leave it booked while the write still completes.
        ok = await asyncio.to_thread(self._write, key, header, chain, size)
        if ok:
            self._counters.inc("blobs_spooled")
            self._update_gauges()
            if self._wake is not None:
                self._wake.set()
        return ok

    def _write(self, key: str, header: bytes, chain: BufferChain, size: int) -> bool:
        name = _name_for(key)
        final = self.dir / name
        tmp = self.dir / f"{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = create_exclusive(tmp, os.O_WRONLY)
            try:
                for view in (header, *chain.views):
                    _write_all(fd, memoryview(view).cast("B"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._mu:
                self._reserved -= size
            logger.warning("ec-s3: cannot spool %s to %s: %s", key, self.dir, exc)
            return False
        with self._mu:
            self._reserved -= size
            self._sizes[name] = size
        return True

    # ------------------------------------------------------------------ draining
    async def _drain_forever(self) -> None:
        assert self._wake is not None
        wait_s = self.retry_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()
            try:
                if self.pending():
                    await self.drain_once()
                wait_s = self.retry_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the task must outlive any error
                self._counters.inc("spool_drain_errors")
                wait_s = min(max(wait_s * 2, self.retry_s), max(self.retry_s, _MAX_BACKOFF_S))
                self._log_unexpected(f"re-uploading from spool {self.dir} (next try in {wait_s:.1f}s)", exc)

    async def drain_once(self) -> int:
        """Re-upload spooled blobs oldest first; stop at the first outage. Returns how
        many left the spool."""
        done = 0
        for path in self.pending():
            entry = await asyncio.to_thread(self._read, path)
            if entry is None:
                continue  # another process took it
            if isinstance(entry, _Rejected):
                self._set_aside(path, entry.reason)
                continue
            if not self._owns(entry.key):
                self._set_aside(path, f"key {entry.key[:200]!r} is not one of this producer's keys")
                continue
            body = memoryview(entry.buf)[entry.offset:]
            size = len(body)
            try:
                outcome: PutOutcome | None = await self._store.put_async(entry.key, body)
            except StoreUnavailable:
                return done  # still down: try again later, in order
            except StoreError as exc:
                logger.warning("ec-s3: dropping spooled %s: %s", entry.key, exc)
                self._counters.inc("spool_failed")
                outcome = None
            except Exception as exc:  # noqa: BLE001 - one bad file must not stop the queue
                strikes = self._strikes[path.name] = self._strikes.get(path.name, 0) + 1
                self._log_unexpected(f"re-uploading {entry.key} (attempt {strikes} of {_MAX_STRIKES})", exc)
                if strikes < _MAX_STRIKES:
                    return done  # in order: try it again after a pause
                self._set_aside(path, f"upload failed {strikes} times: {exc!r}")
                continue
            self._strikes.pop(path.name, None)
            self._remove(path)
            if outcome is PutOutcome.CREATED:
                self._counters.inc("spool_uploaded")
                self._counters.inc("blobs_uploaded")
                self._counters.inc("bytes_uploaded", size)
            elif outcome is PutOutcome.ALREADY_EXISTS:
                self._counters.inc("spool_uploaded")
            done += 1
            self._update_gauges()
        return done

    def _read(self, path: Path) -> _Entry | _Rejected | None:
        """Read a spool file back, trusting nothing in it (runs in a thread)."""
        try:
            fd = open_nofollow(path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink
            return _Rejected(f"cannot be opened safely ({exc.strerror})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return _Rejected("is not a regular file")
            if st.st_uid != os.geteuid():
                return _Rejected(f"is owned by uid {st.st_uid}, not by this user")
            if st.st_size > self.max_bytes:
                return _Rejected(f"is {st.st_size} bytes, above spool_max_bytes")
            buf = bytearray(st.st_size)
            view, pos = memoryview(buf), 0
            while pos < len(buf):
                n = os.readv(fd, [view[pos:]])
                if n == 0:
                    return _Rejected("shrank while being read")
                pos += n
        finally:
            os.close(fd)
        head = len(_MAGIC) + _KEY_LEN.size
        if len(buf) < head or not buf.startswith(_MAGIC):
            return _Rejected("has no spool header (not written by this ec-s3 version)")
        (key_len,) = _KEY_LEN.unpack_from(buf, len(_MAGIC))
        if key_len > _MAX_KEY_BYTES or head + key_len > len(buf):
            return _Rejected("has a malformed spool header")
        try:
            key = bytes(buf[head : head + key_len]).decode("utf-8")
        except UnicodeDecodeError:
            return _Rejected("has a key that is not UTF-8")
        parts = path.name.split("-")
        if len(parts) != 3 or parts[1] != _digest(key):
            return _Rejected("has a name that does not match the key inside it")
        return _Entry(key=key, buf=buf, offset=head + key_len)

    def _set_aside(self, path: Path, reason: str) -> None:
        """Rename a file we will not upload out of the queue; logged once."""
        self._counters.inc("spool_rejected")
        target = path.with_name(path.name + _REJECTED)
        try:
            os.rename(path, target)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._ignored.add(path.name)
            logger.warning("ec-s3: ignoring spool file %s: it %s (and cannot be renamed: %s)", path, reason, exc)
            return
        with self._mu:
            self._sizes.pop(path.name, None)
        self._strikes.pop(path.name, None)
        logger.warning("ec-s3: spool file %s %s; not uploading it, renamed to %s", path, reason, target.name)

    def _remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with self._mu:
            self._sizes.pop(path.name, None)

    def _log_unexpected(self, what: str, exc: Exception) -> None:
        kind = type(exc)
        first = kind not in self._seen_unexpected
        self._seen_unexpected.add(kind)
        logger.warning("ec-s3: unexpected error %s: %r", what, exc, exc_info=first)

    def stop(self) -> None:
        if self._task is not None:
            self._store.background.call_soon(self._task.cancel)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; best effort (some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
