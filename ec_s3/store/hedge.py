"""Hedged GET ranges: a range that runs past its expected time is asked once more, on
another connection, and the first complete answer wins.

Owns :class:`Hedging` (one per store: the expected time of a range, learned from recent
ranges, the hedge deadline and the budget of hedges in flight), :class:`Stopwatch` and
:func:`race`. Does not own what a range is or how its answers are checked (:mod:`.download`),
retries, the breaker or the request permits (:mod:`.client`, :mod:`.permits`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

from ec_s3.log import logger
from ec_s3.store.permits import RequestPermits

__all__ = ["Clock", "Hedging", "Stopwatch", "race"]

T = TypeVar("T")
FLOOR_S = 0.1  # no hedge sooner: below it a hedge would mostly race a busy host's scheduling noise
WARM_AFTER = 8  # completed ranges before the first hedge: a median of fewer is a guess
WINDOW = 64  # recent ranges the medians are taken over: a change of link shows within a few blobs
_POLL_S = 0.01  # how often an overdue range waiting on others (the first head, the caller's buffer) is looked at


class Clock:
    """Seconds, monotonic; a test gives :class:`Hedging` one it moves itself."""

    def now(self) -> float:
        return time.monotonic()


class Stopwatch:
    """The time of a range's latest attempt, from :meth:`start` (its request permit
    held), less its waits on others (the first answer's head, the caller's buffer): a
    queue for a permit and those waits are not the link's time, and must not hedge it.
    (A failed attempt's back-off counts: a hedge then is an early retry on another
    connection.)"""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._start = clock.now()
        self._since: float | None = self._start  # until start(): waiting
        self._waited = 0.0

    @property
    def waiting(self) -> bool:
        return self._since is not None

    def start(self) -> None:
        """An attempt begins (each of a primary's retries starts the watch again)."""
        self._start, self._waited, self._since = self._clock.now(), 0.0, None

    def elapsed(self) -> float:
        now = self._clock.now()
        return now - self._start - self._waited - (now - self._since if self._since is not None else 0.0)

    @contextlib.contextmanager
    def wait(self) -> Iterator[None]:
        """Around an ``await`` on others: its time does not count."""
        since = self._since = self._clock.now()
        try:
            yield
        finally:
            self._waited += self._clock.now() - since
            self._since = None


class Hedging:
    """When a range is overdue, and whether a hedge may go out now.

    The expected time of a range of ``n`` bytes is the median first-byte time plus ``n``
    times the median body time per byte, over the last :data:`WINDOW` completed ranges.
    Two medians, not one per range: ranges differ in length (the first carries a header,
    the last is short, small blobs are one range), and a first byte is paid per request
    whatever its length. Medians, not means: the stalls a hedge is for must not move the
    time they are measured against."""

    def __init__(self, factor: float, max_in_flight: int, *, clock: Clock | None = None) -> None:
        self.factor, self.max_in_flight = factor, max_in_flight
        self.clock = clock or Clock()
        self.in_flight = 0
        self._first_byte: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._per_byte: collections.deque[float] = collections.deque(maxlen=WINDOW)

    @property
    def warm(self) -> bool:
        return len(self._first_byte) >= WARM_AFTER

    def stopwatch(self) -> Stopwatch:
        return Stopwatch(self.clock)

    def record(self, first_byte_s: float, body_s: float, nbytes: int) -> None:
        """A range completed: ``first_byte_s`` to its answer's head, ``body_s`` for its ``nbytes``."""
        self._first_byte.append(first_byte_s)
        if nbytes > 0:
            self._per_byte.append(body_s / nbytes)

    def deadline(self, nbytes: int) -> float | None:
        """Seconds after which a range of ``nbytes`` (0: its head alone) is hedged; None:
        never (hedging off, or too few ranges seen yet)."""
        if self.factor <= 0 or self.max_in_flight <= 0 or not self.warm:
            return None
        per_byte = statistics.median(self._per_byte) if self._per_byte else 0.0
        return max(FLOOR_S, self.factor * (statistics.median(self._first_byte) + per_byte * nbytes))

    def take(self) -> bool:
        """One of ``max_in_flight`` hedges, if one is free (else no hedge: the range waits)."""
        if self.in_flight >= self.max_in_flight:
            return False
        self.in_flight += 1
        return True

    def give_back(self, _: Any = None) -> None:
        self.in_flight -= 1


class HedgingStore(Protocol):
    """What :func:`race` needs of :class:`ec_s3.store.client.S3Store`."""

    hedging: Hedging
    stats: Any
    _permits: RequestPermits | None


async def _nothing(_: Any) -> None:
    return None


async def race(
    store: HedgingStore, nbytes: int, primary: Callable[[Stopwatch], Awaitable[T]],
    hedge: Callable[[Stopwatch], Awaitable[T]], discard: Callable[[T], Awaitable[None]] = _nothing,
) -> T:
    """``primary``'s answer, or ``hedge``'s if the primary is still running at the
    deadline of a range of ``nbytes`` and the hedge completes first. A hedge goes out only
    when the policy is warm, one of its hedges and one request permit are free (a hedge
    never queues behind real work). The loser is cancelled and awaited on every way out
    (``discard`` releases an answer it completed all the same); when both fail, the
    primary's error is raised. ``hedge`` must not write where ``primary`` does."""
    hedging = store.hedging
    watch = hedging.stopwatch()
    first = asyncio.ensure_future(primary(watch))
    second: asyncio.Future[T] | None = None
    winner: asyncio.Future[T] | None = None
    try:
        deadline = hedging.deadline(nbytes)
        if deadline is not None and await _overdue(first, watch, deadline) and _permit_free(store) \
                and hedging.take():
            store.stats.hedges += 1
            second = asyncio.ensure_future(hedge(hedging.stopwatch()))
            second.add_done_callback(hedging.give_back)  # runs even if cancelled before it started
            pending: set[asyncio.Future[T]] = {first, second}
            while pending and not _succeeded(first):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if _succeeded(second) and not _succeeded(first):
                    store.stats.hedges_won += 1
                    winner = second
                    return second.result()
        winner = first
        return await first  # its answer, or (both failed) its error
    finally:
        await _end_losers([t for t in (first, second) if t is not None and t is not winner], discard)


async def _overdue(task: asyncio.Future[Any], watch: Stopwatch, deadline: float) -> bool:
    """Whether ``task`` is still running once ``watch`` passes ``deadline``."""
    while not task.done():
        left = deadline - watch.elapsed()
        if left <= 0 and not watch.waiting:
            return True
        await asyncio.wait({task}, timeout=left if left > 0 else _POLL_S)
    return False


def _permit_free(store: HedgingStore) -> bool:
    return store._permits is not None and store._permits.any_free()


def _succeeded(task: asyncio.Future[Any] | None) -> bool:
    return task is not None and task.done() and not task.cancelled() and task.exception() is None


async def _end_losers(losers: list[asyncio.Future[T]], discard: Callable[[T], Awaitable[None]]) -> None:
    for task in losers:
        task.cancel()
    # Their connections, permits and buffers are released by their own ``async with``s.
    await asyncio.gather(*losers, return_exceptions=True)
    for task in losers:
        if _succeeded(task):  # completed before the cancellation reached it
            try:
                await discard(task.result())
            except Exception as exc:  # noqa: BLE001 - releasing a loser must not fail the winner
                logger.debug("ec-s3: releasing a hedged request's loser failed: %s", exc)
