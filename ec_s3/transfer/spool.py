"""Producer outage spool: blobs whose upload failed wait on local disk for the store.

When an upload exhausts its retries (store down, 503 storms, circuit open), the
publisher writes the blob here instead of dropping it: written with aiofiles to a
temporary name, fsynced and renamed, so a crash leaves either a whole blob or none.
A background task re-uploads spooled blobs oldest first whenever the store answers
again, and a new process resumes whatever an earlier one left. The spool is bounded
in bytes; beyond that blobs are dropped and counted. Nothing here ever runs on the
model step.

File names are ``<time_ns>__<base64url(key)>.blob``: ordering by name is ordering by
age, and the key survives a restart without a sidecar file.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import time
from pathlib import Path

import aiofiles
import aiofiles.os

from ec_s3.log import logger
from ec_s3.transfer.counters import Counters
from ec_s3.store.client import AccessDenied, Body, BufferChain, PutOutcome, S3Store, StoreError, StoreUnavailable

__all__ = ["Spool"]

_SUFFIX = ".blob"


def _name_for(key: str) -> str:
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return f"{time.time_ns():020d}__{encoded}{_SUFFIX}"


def _key_of(name: str) -> str | None:
    try:
        encoded = name[: -len(_SUFFIX)].split("__", 1)[1]
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (IndexError, ValueError):
        return None


class Spool:
    def __init__(self, directory: str, max_bytes: int, retry_s: float, store: S3Store, counters: Counters) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.retry_s = retry_s
        self._store = store
        self._counters = counters
        self._lock = asyncio.Lock()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        for stale in self.dir.glob("*.tmp"):  # torn writes of a crashed process
            stale.unlink(missing_ok=True)
        self.used = sum(p.stat().st_size for p in self.dir.glob(f"*{_SUFFIX}"))
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._counters.set_gauge("spool_bytes", self.used)
        self._counters.set_gauge("spool_blobs", len(list(self.dir.glob(f"*{_SUFFIX}"))))

    def pending(self) -> list[Path]:
        return sorted(self.dir.glob(f"*{_SUFFIX}"))

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

    async def save(self, key: str, body: Body) -> bool:
        """Write ``body`` to the spool; False (and counted) if the spool is full."""
        size = len(body)
        async with self._lock:
            if self.used + size > self.max_bytes:
                self._counters.inc("spool_full_drops")
                return False
            self.used += size
        final = self.dir / _name_for(key)
        tmp = self.dir / f"{final.name}.{secrets.token_hex(4)}.tmp"
        try:
            chain = body if isinstance(body, BufferChain) else BufferChain([body])
            async with aiofiles.open(tmp, "wb") as f:
                for view in chain.views:
                    await f.write(view)
                await f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            await aiofiles.os.rename(tmp, final)
        except OSError as exc:
            self.used -= size
            with contextlib.suppress(OSError):
                tmp.unlink()
            logger.warning("ec-s3: cannot spool %s to %s: %s", key, self.dir, exc)
            return False
        self._counters.inc("blobs_spooled")
        self._update_gauges()
        if self._wake is not None:
            self._wake.set()
        return True

    async def _drain_forever(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.retry_s)
            self._wake.clear()
            if self.pending():
                await self.drain_once()

    async def drain_once(self) -> int:
        """Re-upload spooled blobs oldest first; stop at the first outage. Returns how
        many left the spool."""
        done = 0
        for path in self.pending():
            key = _key_of(path.name)
            if key is None:
                logger.warning("ec-s3: removing unreadable spool file %s", path)
                path.unlink(missing_ok=True)
                continue
            try:
                async with aiofiles.open(path, "rb") as f:
                    body = bytearray(await f.read())
            except FileNotFoundError:
                continue  # another process took it
            try:
                outcome = await self._store.put_async(key, body)
            except StoreUnavailable:
                return done  # still down: try again later, in order
            except (AccessDenied, StoreError) as exc:
                logger.warning("ec-s3: dropping spooled %s: %s", key, exc)
                self._counters.inc("spool_failed")
                outcome = None
            size = len(body)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                async with self._lock:
                    self.used -= size
            if outcome is PutOutcome.CREATED:
                self._counters.inc("spool_uploaded")
                self._counters.inc("blobs_uploaded")
                self._counters.inc("bytes_uploaded", size)
            elif outcome is PutOutcome.ALREADY_EXISTS:
                self._counters.inc("spool_uploaded")
            done += 1
            self._update_gauges()
        return done

    def stop(self) -> None:
        if self._task is not None:
            self._store.background.call_soon(self._task.cancel)
