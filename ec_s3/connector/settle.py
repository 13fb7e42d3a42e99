"""Whether an idle engine must step again so that its workers' counters reach ``/metrics``.

vLLM ships connector stats only with a step, and asks ``has_pending_push_work`` after each
step whether to keep stepping. This watch says yes from a step that changes worker
counters until the workers' snapshot shows that step settled, at most ``max_s``. Owns that
decision and the step numbers the workers report back. Does not own the shared-memory
route (:mod:`ec_s3.transfer.shared_stats`) or which steps change worker counters
(:mod:`ec_s3.connector.scheduler`). Details: docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ec_s3.log import logger
from ec_s3.transfer.counters import Counters
from ec_s3.transfer.shared_stats import SharedStatsReader

__all__ = ["CounterWatch"]

# The longest an idle engine keeps stepping after a watched step: uploads slower than
# this (an outage, retries) reach /metrics with the engine's next step.
MAX_S = 5.0


class CounterWatch:
    def __init__(self, reader: SharedStatsReader | None, counters: Counters, *, max_s: float = MAX_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reader = reader
        self._counters = counters
        self._max_s = max_s
        self._clock = clock
        self._step = 0  # the last watched step's number (what its workers report back)
        self._until = 0.0  # 0: not watching
        self._since = 0  # the reader's collections when the last watched step began

    def watch(self) -> int:
        """This step changes worker counters: its number for the workers to report
        back in their snapshot (0: no reader, nothing to wait for)."""
        if self._reader is None:
            return 0
        self._step += 1
        self._until = self._clock() + self._max_s
        self._since = self._reader.progress.collections
        self._reader.hurry(self._max_s)
        return self._step

    def pending(self) -> bool:
        """vLLM's ``has_pending_push_work``: True while a watched step's worker counters
        have not been taken for ``/metrics`` yet (called several times per engine loop:
        memory reads only)."""
        if not self._until:
            return False
        assert self._reader is not None
        progress = self._reader.progress  # before undelivered(): see SharedStatsReader
        if not progress.writers and progress.collections > self._since:
            self._until = 0.0  # a collection since found no worker's file: nothing will come
            return False
        settled = progress.step >= self._step and not progress.uploads_pending
        if settled and not self._reader.undelivered():
            self._until = 0.0
            return False
        if self._clock() > self._until:
            logger.debug("ec-s3: worker counters of step %d not in after %.0f s (%d uploads in flight); they "
                         "reach /metrics with the engine's next step", self._step, self._max_s,
                         progress.uploads_pending)
            self._until = 0.0
            return False
        return True

    def note_step(self, scheduled_anything: bool) -> None:
        """Count a step that scheduled nothing while watching: one this watch caused."""
        if self._until and not scheduled_anything:
            self._counters.inc("settle_steps")
