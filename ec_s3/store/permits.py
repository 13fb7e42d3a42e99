"""The store's concurrency bound: at most ``n`` requests in flight, each waited for and held for a bounded time.

Owns the semaphore and both deadlines: a wait for a permit past it is a
:class:`~.errors.StoreBusy`, an attempt holding one past it is cancelled and becomes a
:class:`~.errors.StoreTimeout`, entered by each task that uses the permit (:class:`Lease`).
(A "permit" is the store's; a "slot" is always a staging file.) Does not own retries, the
breaker and what the request does (:mod:`.client`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ec_s3.store.errors import StoreBusy, StoreTimeout

__all__ = ["Lease", "RequestPermits"]


class Lease:
    """One permit, taken by :meth:`RequestPermits.lease`, and the deadline of its attempt
    as a point in loop time. Its uses may run in other tasks than the one that took it (a
    GET's first answer is opened in the caller's task, its body read in another while the
    later ranges go out): each use is bounded in its own task (:meth:`bounded`), so a
    deadline ends there as a :class:`StoreTimeout`, never as the cancellation of the task
    that took the permit, nor of whatever that task awaits meanwhile."""

    def __init__(self, op: str, key: str, deadline_s: float) -> None:
        self._op, self._key, self._limit = op, key, deadline_s
        self.deadline = asyncio.get_running_loop().time() + deadline_s

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """The body of the ``async with``, in this task, until the deadline at most (else
        it is cancelled and :class:`StoreTimeout` raised; at once when it has passed)."""
        timeout = asyncio.timeout_at(self.deadline)
        try:
            async with timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise  # a timeout of the request's own, typed by the caller
            raise StoreTimeout(self._op, self._key, f"attempt took over request_timeout_s={self._limit:g}s") from None


class RequestPermits:
    """``n`` permits on one event loop; :meth:`hold` one for one attempt of a request."""

    def __init__(self, n: int, deadline_s: float) -> None:
        self._sem = asyncio.Semaphore(n)
        self._deadline = deadline_s

    @contextlib.asynccontextmanager
    async def lease(self, op: str, key: str) -> AsyncIterator[Lease]:
        """A permit until the ``async with`` ends, waited for at most the deadline (else
        :class:`StoreBusy`); what runs under it is bounded by :meth:`Lease.bounded`."""
        try:
            async with asyncio.timeout(self._deadline):
                await self._sem.acquire()
        except TimeoutError:
            raise StoreBusy(op, key, f"no request permit free within request_timeout_s={self._deadline:g}s") from None
        try:
            yield Lease(op, key, self._deadline)
        finally:
            self._sem.release()

    def any_free(self) -> bool:
        """Whether a permit is free now (a hedge takes one only then: it never queues)."""
        return not self._sem.locked()

    @contextlib.asynccontextmanager
    async def hold(self, op: str, key: str) -> AsyncIterator[None]:
        """A permit for the body of the ``async with``, run in this task: waited for at
        most the deadline (else :class:`StoreBusy`), then held at most the deadline
        (else the body is cancelled and :class:`StoreTimeout` raised)."""
        async with self.lease(op, key) as lease, lease.bounded():
            yield
