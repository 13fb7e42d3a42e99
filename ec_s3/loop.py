"""One asyncio event loop per process, in a daemon thread, for all of ec-s3's I/O.

vLLM's engine loop and model step hand coroutines to it and get futures back; one loop
per process (recreated after ``fork``) keeps threads and pools few. Owns that thread and
which CPUs it may run on (``io_cpus``); does not own what runs on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ec_s3.log import logger

__all__ = ["BackgroundLoop", "shared_loop"]

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop running forever in its own daemon thread."""

    def __init__(self, name: str = "ec-s3-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; thread-safe, never blocks."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a plain callback on the loop thread; thread-safe, never blocks."""
        self._loop.call_soon_threadsafe(fn, *args)

    def set_cpus(self, cpus: Iterable[int] | None) -> None:
        """Let the loop thread, and the helper threads it starts from now on, run on
        ``cpus`` (None: leave them as they are). Thread-safe, never blocks; a refusal
        (an empty intersection with the cgroup's CPUs) is logged, not raised."""
        if cpus is None or not hasattr(os, "sched_setaffinity"):
            return
        wanted = frozenset(cpus)

        def apply() -> None:
            try:
                os.sched_setaffinity(0, wanted)  # pid 0: the calling thread, on Linux
            except (OSError, ValueError) as exc:
                logger.warning("ec-s3: cannot move the I/O thread to CPUs %s: %s; set io_cpus", sorted(wanted), exc)

        self.call_soon(apply)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Block the calling thread until ``coro`` finishes (CLI, tests, shutdown)."""
        if self.in_loop_thread():
            raise RuntimeError("BackgroundLoop.run() called from its own loop thread")
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is left, stop the loop and join the thread."""
        if not self.is_running:
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_cancel_all()).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("ec-s3: background tasks did not stop within %.1fs", timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


_shared: BackgroundLoop | None = None
_shared_pid: int | None = None
_shared_lock = threading.Lock()


def shared_loop() -> BackgroundLoop:
    """The process-wide loop, started on first use and again in a forked child."""
    global _shared, _shared_pid
    with _shared_lock:
        if _shared is None or _shared_pid != os.getpid() or not _shared.is_running:
            _shared = BackgroundLoop()
            _shared_pid = os.getpid()
        return _shared
