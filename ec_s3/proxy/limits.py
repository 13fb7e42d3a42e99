"""What the proxy's clients may hold at once in memory: a byte budget shared by the
request bodies in flight.

Owns :class:`ByteBudget`: a counter on one event loop, charged a body's size times
:data:`BODY_COST_FACTOR` and released by its holders on every exit path (a context
manager). It does not own reading bodies, deadlines, the count of requests in flight or
answers (:mod:`.edge`, :mod:`.chat`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["BODY_COST_FACTOR", "ByteBudget", "NoRoom", "Reservation"]

# Peak memory of a request per byte of its body, measured on 8-59 MB image bodies: the
# raw bytes, the parsed JSON, each item's serialisation, the encoder and p/d bodies.
BODY_COST_FACTOR = 8


class NoRoom(Exception):
    """The bytes asked for did not fit the budget before the deadline."""


class ByteBudget:
    """``total`` bytes shared by the requests in flight; :meth:`hold` waits until its
    share fits (not in arrival order: small shares pass a large one that waits)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int, deadline: float) -> AsyncIterator[Reservation]:
        """Hold ``nbytes`` (at most :attr:`total`) until the block ends; raises
        :class:`NoRoom` when they do not fit before the loop time ``deadline``."""
        if nbytes > self.total:
            raise ValueError(f"{nbytes} bytes can never fit a budget of {self.total}")
        loop = asyncio.get_running_loop()
        while self.used + nbytes > self.total:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise NoRoom(f"{nbytes} bytes did not fit the budget in time") from None
            finally:
                self._waiters.remove(waiter)
        self.used += nbytes
        reservation = Reservation(self, nbytes)
        try:
            yield reservation
        finally:
            self._release(reservation.nbytes)

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class Reservation:
    """Bytes held in a :class:`ByteBudget`; :meth:`shrink` gives back what a request turned
    out not to need (a chunked body, charged for the largest, was smaller)."""

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def shrink(self, nbytes: int) -> None:
        if nbytes < self.nbytes:
            extra, self.nbytes = self.nbytes - nbytes, nbytes
            self._budget._release(extra)
