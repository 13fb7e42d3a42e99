"""The circuit breaker of the S3 store: stop hammering a store that is down.

Owns the open/closed/probing state and its one log line per transition. Does not own
deciding what counts as a failure (the store's request loop,
:meth:`ec_s3.store.client.S3Store._call`, reports successes and failures to it) nor any
I/O. Loop thread only: no locks.
"""

from __future__ import annotations

import time

from ec_s3.log import logger

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Stops hammering a store that is down.

    After ``threshold`` consecutive requests exhaust their retries, the breaker opens
    for ``cooldown_s`` (doubling on each failed probe, up to ``max_cooldown_s``):
    requests then fail at once, so producers spool or drop and consumers encode
    locally instead of each waiting out timeouts. After the cooldown one probe
    request goes through; its success closes the breaker, its failure reopens it for
    longer, and if it ends with no verdict on the store (the caller's own error,
    cancellation, no credentials) the probe is freed so the next request probes. One
    log line per transition, never one per request.

    Every admitted request holds a ticket (:meth:`allow`) that it must hand back to
    :meth:`release` however it ends, so that no probe can stay pending forever.
    """

    def __init__(self, threshold: int, cooldown_s: float, max_cooldown_s: float = 60.0) -> None:
        self.threshold = threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max(max_cooldown_s, cooldown_s)
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self.probing = False
        self._tickets = 0  # the last probe ticket handed out

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allow(self) -> int | None:
        """May a request go to the network now? None: no. Otherwise its ticket: 0 for an
        ordinary request, a fresh positive number for the probe. (Loop thread only.)"""
        if self.opened_at is None:
            return 0
        if self.probing or time.monotonic() - self.opened_at < self.cooldown_s:
            return None
        self.probing = True
        self._tickets += 1
        return self._tickets

    def release(self, ticket: int) -> None:
        """The request holding ``ticket`` is over. If it was the pending probe and it
        reported neither success nor failure, free the probe: the breaker stays
        open and, its cooldown being over, lets the next request probe."""
        if ticket and ticket == self._tickets and self.probing:
            self.probing = False

    def success(self) -> None:
        self.failures = 0
        if self.opened_at is not None:
            logger.warning("ec-s3: S3 store is answering again; circuit closed after %.1fs", time.monotonic() - self.opened_at)
        self.opened_at, self.probing, self.cooldown_s = None, False, self.base_cooldown_s

    def failure(self, reason: str, ticket: int = 0) -> None:
        self.failures += 1
        if self.opened_at is not None:
            # Only the probe's failure reopens; a request admitted before the breaker
            # opened may still fail now, which says nothing about the probe.
            if ticket and ticket == self._tickets and self.probing:  # the probe failed: stay open, longer
                self.probing = False
                self.opened_at = time.monotonic()
                self.cooldown_s = min(self.max_cooldown_s, self.cooldown_s * 2)
            return
        if self.failures >= self.threshold:
            self.opened_at = time.monotonic()
            logger.warning(
                "ec-s3: S3 store unavailable (%d requests failed in a row, last: %s); circuit open: "
                "producers spool or drop, consumers encode locally; next probe in %.1fs",
                self.failures, reason, self.cooldown_s,
            )
