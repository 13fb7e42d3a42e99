"""The store's concurrency bound: at most ``n`` requests in flight, each waited for and held for a bounded time.

Why both bounds: ``read_timeout_s`` bounds each silence of a server, not a whole
request, so a server that trickles a body (a byte now and then) held a request, and
its permit, forever; a few such requests and every other request of the process
queued behind them without end. An attempt that holds a permit longer than its
deadline is cancelled (its connection closed by the path's own cleanup) and becomes
a :class:`~.errors.StoreTimeout`, retried like any timeout; a wait for a permit that
outlasts the deadline is a :class:`~.errors.StoreBusy`.

(A "permit" is the store's; a "slot" is always a staging file, :mod:`ec_s3.transfer.staging`.)

Owns: the semaphore and both deadlines. Does not own retries, the breaker and what
the request does (:mod:`.client`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ec_s3.store.errors import StoreBusy, StoreTimeout

__all__ = ["RequestPermits"]


class RequestPermits:
    """``n`` permits on one event loop; :meth:`hold` one for one attempt of a request."""

    def __init__(self, n: int, deadline_s: float) -> None:
        self._sem = asyncio.Semaphore(n)
        self._deadline = deadline_s

    @contextlib.asynccontextmanager
    async def hold(self, op: str, key: str) -> AsyncIterator[None]:
        """A permit for the body of the ``async with``: waited for at most the deadline
        (else :class:`StoreBusy`), then held at most the deadline (else the body is
        cancelled and :class:`StoreTimeout` raised)."""
        try:
            async with asyncio.timeout(self._deadline):
                await self._sem.acquire()
        except TimeoutError:
            raise StoreBusy(op, key, f"no request permit free within request_timeout_s={self._deadline:g}s") from None
        deadline = asyncio.timeout(self._deadline)
        try:
            async with deadline:
                yield
        except TimeoutError:
            if not deadline.expired():
                raise  # a timeout of the request's own, typed by the caller
            raise StoreTimeout(op, key, f"attempt took over request_timeout_s={self._deadline:g}s") from None
        finally:
            self._sem.release()
