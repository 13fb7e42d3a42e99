"""Admission as a decision: for one item of one request, what the scheduler does next.

:meth:`Admission.decide` is a pure function of what is known at one moment and of the
role's policy (:class:`ProducerAdmission`, :class:`ConsumerAdmission`,
:class:`AggregatedAdmission`); it answers one :class:`Decision`. Owns the admission rules,
the wait budgets and the lookup timing. Does not apply a decision
(:mod:`ec_s3.connector.scheduler`) nor own the item states (:mod:`ec_s3.connector.items`).
No I/O, no clock. Pending and present promises: the glossary in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from ec_s3.config import ECS3Config
from ec_s3.connector.items import RETRYABLE, Item, ItemState

if TYPE_CHECKING:
    from ec_s3.connector.transfer_params import Promise

__all__ = [
    "Action",
    "Admission",
    "AggregatedAdmission",
    "Ask",
    "ConsumerAdmission",
    "Decision",
    "LATER",
    "ProducerAdmission",
    "answer_outcome",
    "promise_poll_interval",
]

# Polling a promised blob that is not visible yet. The schedule depends on how long
# the request has waited, never on how many polls the item had (an item outlives
# requests): back to back, at most one GET in flight per item and at least
# _POLL_DENSE_INTERVAL_S between starts, for the first _POLL_DENSE_S (small blobs land
# then); after that every _POLL_FRACTION of the time waited so far, so a blob is picked
# up within ~5% of its own upload time, capped at POLL_CAP_S. Cost per waiting item:
# <= 1 GET per max(2 ms, one 404 round trip) for 100 ms (<= 50), then ~20 per tenfold
# of the wait: ~50-100 GETs for a 1 s wait, ~130 for the 5 s default promised_wait_s.
_POLL_DENSE_S = 0.1
_POLL_DENSE_INTERVAL_S = 0.002
_POLL_FRACTION = 0.05
POLL_CAP_S = 0.25
# An invalid blob stays invalid (blobs are written once), and a store that answered an
# error is not helped by being asked every 2 ms (its client already retried): those
# answers are polled again no sooner than this after they came.
_FAILED_POLL_MIN_S = 0.05
# Staging had no room (pinned slots hold it, or the blob is larger than it): that
# lasts, so back off further. Each attempt is a GET, and the failed allocation evicts
# unpinned staged blobs that other requests may be about to use.
_NO_SPACE_BASE_S = 0.05
NO_SPACE_MAX_S = 2.0


def promise_poll_interval(waited_s: float) -> float:
    """Seconds from the start of one poll of a promised blob to the start of the next,
    for a request that has waited ``waited_s`` for it."""
    if waited_s < _POLL_DENSE_S:
        return _POLL_DENSE_INTERVAL_S
    return min(POLL_CAP_S, _POLL_FRACTION * waited_s)


class Action(enum.Enum):
    HIT = "hit"  # ready here: hold it (a consumer pins its staged slot), then no wait
    WAIT = "wait"  # defer the request; ask again at the next step
    PROCEED = "proceed"  # nothing to wait for: vLLM asks has_cache_item, else encodes it
    ENCODE_LOCALLY = "encode_locally"  # vLLM encodes it for this request, never asked again
    # The store cannot serve it: encoded locally if the request carries the media,
    # else the request alone fails.
    UNAVAILABLE = "unavailable"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    lookup: bool = False  # start a lookup first: of the item, or of a new one if there is none
    renew: bool = False  # forget the item first: its answer is too old to trust
    clock: bool = False  # the request's wait for the item begins now, unless it already began
    uses_item: bool = True  # the request keeps the item in the table (False: it never will)
    counter: str | None = None  # the counter to bump
    # What the request's lookup of the item decided (lookups_total{outcome}), once per
    # request and item: "hit", "miss", "timeout" (its wait ran out first) or "error"
    # (failed, invalid, no room in staging); LATER: whatever the running lookup answers
    # (the request went on without waiting for it); None: nothing decided yet (a wait,
    # whose polls are no outcome), or the bucket was not asked.
    outcome: str | None = None
    reason: str = ""  # why the store cannot serve it (UNAVAILABLE)
    gone: bool = False  # marked present, and the bucket does not have it: the request's answer says so


@dataclasses.dataclass(frozen=True)
class Ask:
    """What is known of one item of one request at one moment."""

    item: Item | None  # the table's item for the key, if any
    promise: Promise | None  # a producer's promise of the blob, checked
    has_media: bool  # vLLM could encode it (without media only the store can provide it)
    since: float | None  # when the request began waiting for it
    now: float
    workers_read_staging: bool = True
    published_at: float | None = None  # when this engine last published the item (ec_both)


_PROCEED = Decision(Action.PROCEED)
_WAIT = Decision(Action.WAIT)
_HIT = Decision(Action.HIT, outcome="hit")
LATER = "later"


def answer_outcome(state: ItemState) -> str | None:
    """The outcome a lookup's last answer decides for a request that takes it as final."""
    if state in (ItemState.STAGED, ItemState.PRESENT):
        return "hit"
    if state is ItemState.MISSING:
        return "miss"
    if state in (ItemState.FAILED, ItemState.INVALID, ItemState.NO_SPACE):
        return "error"
    return None


class Admission:
    """The rules both roles share; a subclass says what a hit is and what each wait is."""

    hit_state: ItemState  # the item state that answers "hit"
    observes_promise_wait: bool = True  # a served or abandoned promise's wait is observed

    def __init__(self, config: ECS3Config) -> None:
        self.config = config

    def decide(self, ask: Ask) -> Decision:
        """What to do with ``ask``'s item now; reads ``ask`` and changes nothing."""
        raise NotImplementedError

    def fits(self, promise: Promise | None) -> str:
        """Why a promised blob cannot be staged here ("" when it can)."""
        return ""

    def next_lookup_at(self, item: Item, promise: Promise | None, waited: float) -> float:
        """When a finished lookup of ``item`` (a retryable answer) may run again, for a
        request that has waited ``waited`` seconds for it."""
        if item.state is ItemState.NO_SPACE:
            return item.checked_at + min(NO_SPACE_MAX_S, _NO_SPACE_BASE_S * 2 ** max(0, item.repeats - 1))
        if promise is None:
            return item.checked_at + self.config.negative_cache_ttl_s
        if item.state is ItemState.MISSING:
            return item.started_at + promise_poll_interval(waited)
        # Invalid or failed: the answer stands for a while (a blob is written once).
        return item.checked_at + max(_FAILED_POLL_MIN_S, promise_poll_interval(waited))

    def _decide(self, ask: Ask, promise: Promise | None, budget: float, encode_first: bool = False) -> Decision:
        """The shared path, once the role chose which promise counts and the wait budget."""
        if promise is None and ask.has_media and self.config.lookup == "promised":
            return _PROCEED
        item = ask.item
        renew = item is not None and self._expired(item, ask.now)
        if item is not None and not renew and item.state is self.hit_state:
            return _HIT
        too_large = self.fits(promise)
        if too_large:
            return Decision(Action.UNAVAILABLE, renew=renew, reason=too_large)
        since = ask.now if ask.since is None else ask.since
        if item is None or renew:
            lookup, looking = True, True
        elif promise is not None and promise.present and item.state is ItemState.MISSING:
            # A present blob is not polled for: one miss seen since the request came is
            # the answer. A miss from before it may predate the upload: ask once more.
            lookup = item.started_at < since
            looking = lookup
        else:
            lookup = item.state in RETRYABLE and ask.now >= self.next_lookup_at(item, promise, ask.now - since)
            looking = lookup or item.looking
        if not looking:
            assert item is not None
            then = self._answered(ask, item, promise, since, budget)
        elif ask.now < since + budget:
            then = _WAIT
        else:
            then = self._timed_out(ask, promise, budget, encode_first)
        return dataclasses.replace(then, lookup=lookup, renew=renew, clock=True)

    def _expired(self, item: Item, now: float) -> bool:
        """A bucket answer seen long ago: gc or a lifecycle rule may have deleted the blob
        since. Looked up again; if it is gone, the encoder runs and the publisher uploads
        it anew."""
        return item.state is ItemState.PRESENT and now - item.checked_at > self.config.present_ttl_s

    @staticmethod
    def _timed_out(ask: Ask, promise: Promise | None, budget: float, encode_first: bool) -> Decision:
        """A lookup still runs and the request's wait for it is over."""
        if encode_first:
            # The HEAD goes on in the background: its answer is kept for the next
            # request of this item; this one is encoded now.
            # Without a wait (budget 0) the request never asked for the answer: the
            # HEAD's answer, when it comes, is its outcome.
            return Decision(Action.ENCODE_LOCALLY, outcome="timeout" if budget else LATER)
        if promise is not None:
            why = f"the blob did not arrive within promised_wait_s={budget:g}s"
            return Decision(Action.UNAVAILABLE, counter="promise_timeouts", reason=why, outcome="timeout")
        if not ask.has_media:
            why = f"its lookup did not finish within lookup_wait_s={budget:g}s"
            return Decision(Action.UNAVAILABLE, reason=why, outcome="timeout")
        return Decision(Action.ENCODE_LOCALLY, outcome="timeout")

    @staticmethod
    def _answered(ask: Ask, item: Item, promise: Promise | None, since: float, budget: float) -> Decision:
        """The last lookup answered something other than a hit, and no new one is due."""
        # (the other role's answer, present for a consumer or staged for a producer, is none)
        outcome = answer_outcome(item.state) if item.state in RETRYABLE else None
        if promise is None:
            if not ask.has_media:
                why = f"nobody promised it and the bucket lookup came back {item.state.value}"
                return Decision(Action.UNAVAILABLE, reason=why, outcome=outcome)
            # a miss (or a failed lookup): the encoder runs locally
            return Decision(Action.PROCEED, outcome=outcome)
        if item.state is ItemState.MISSING and promise.present:
            why = "it was marked present but the bucket does not have it (deleted by gc or a lifecycle rule?)"
            return Decision(Action.UNAVAILABLE, counter="present_missing", reason=why, gone=True, outcome="miss")
        if item.state is ItemState.INVALID:
            return Decision(Action.UNAVAILABLE, reason=f"the stored blob is invalid ({item.reason})", outcome="error")
        if item.state is ItemState.FAILED and item.outage:
            return Decision(Action.UNAVAILABLE, reason=f"the store is unavailable ({item.reason})", outcome="error")
        if ask.now < since + budget:
            return _WAIT  # a poll's answer decides nothing while the promise may still come
        why = f"the blob was still {item.state.value} ({item.reason}) after promised_wait_s={budget:g}s"
        return Decision(Action.UNAVAILABLE, counter="promise_timeouts", reason=why, outcome="timeout")


class ConsumerAdmission(Admission):
    """A consumer (also one that produces): a hit is a blob staged and validated here."""

    hit_state = ItemState.STAGED

    def __init__(self, config: ECS3Config, staging_capacity: int) -> None:
        super().__init__(config)
        self.staging_capacity = staging_capacity

    def decide(self, ask: Ask) -> Decision:
        if not ask.workers_read_staging:
            # A hit staged here could not reach a worker on another host.
            if ask.promise is None and ask.has_media:
                return Decision(Action.PROCEED, uses_item=False)  # nobody promised it: as for a miss
            why = "this engine's workers cannot read its staging area (they run on another host)"
            return Decision(Action.UNAVAILABLE, uses_item=False, reason=why)
        budget = self.config.promised_wait_s if ask.promise else self.config.lookup_wait_s
        return self._decide(ask, ask.promise, budget)

    def fits(self, promise: Promise | None) -> str:
        if promise is not None and promise.size_bytes is not None and promise.size_bytes > self.staging_capacity:
            return f"the blob ({promise.size_bytes} bytes) is larger than staging_bytes={self.staging_capacity}"
        return ""


class ProducerAdmission(Admission):
    """A producer that is no consumer: a hit is a blob the bucket holds (HEAD), which
    lets vLLM skip the encoder. The bytes are of no use to it, so for an item whose
    media it has the bucket's answer must not delay the encoder (producer_lookup_wait_s),
    and nobody's promise is waited for."""

    hit_state = ItemState.PRESENT
    observes_promise_wait = False

    def decide(self, ask: Ask) -> Decision:
        if ask.has_media:
            return self._decide(ask, None, self.config.producer_lookup_wait_s, encode_first=True)
        budget = self.config.promised_wait_s if ask.promise else self.config.lookup_wait_s
        return self._decide(ask, ask.promise, budget)



class AggregatedAdmission(ConsumerAdmission):
    """A consumer that also produces (``ec_both``: one server of a fleet sharing a bucket),
    which **encodes first**: an item nobody promised never waits for the bucket.

    Its own encoder is right there, so waiting for a lookup that will mostly miss (every
    new image) only delays the request: measured on two such servers, goodput on fresh
    images fell to 0.49x of plain servers' while every new image waited out its GET.
    So for an item with its media and no promise, a lookup (a GET into staging) starts
    when the request is first asked about, and the request goes on at once: vLLM encodes
    the item unless the lookup is back, staged, before the item's encoder turn (a later
    step: the request waited for room in the batch, or its earlier chunks or items came
    first). A lookup that loses the race is not wasted: the blob stays staged for the
    next request of the item here. Asking pays, and the request waits for the answer as
    on a consumer, where the blob is known to be there: items the proxy marked present or
    pending (``promised_wait_s``), and items this engine published itself since the
    lookup's last miss (``lookup_wait_s``; a miss older than the upload is asked again).

    Cost: one GET per item nobody promised (a 404 for a new image), started at most once
    per ``negative_cache_ttl_s`` per item after a miss, never waited for; one GET,
    waited for, per repeat of an item published here and no longer staged; no HEAD.
    """

    def decide(self, ask: Ask) -> Decision:
        if ask.promise is not None or not ask.has_media or not ask.workers_read_staging:
            return super().decide(ask)
        if ask.published_at is not None:
            item = ask.item
            stale = item is not None and item.state is ItemState.MISSING and item.started_at < ask.published_at
            decision = self._decide(dataclasses.replace(ask, item=None) if stale else ask, None,
                                    self.config.lookup_wait_s)
            return dataclasses.replace(decision, renew=True) if stale else decision
        if self.config.lookup == "promised":
            return _PROCEED
        item = ask.item
        renew = item is not None and self._expired(item, ask.now)
        if item is not None and not renew and item.state is self.hit_state:
            return _HIT
        lookup = item is None or renew or (
            item.state in RETRYABLE and ask.now >= self.next_lookup_at(item, None, 0.0))
        # The request does not wait: the lookup's answer is its outcome, when it comes
        # (a remembered answer now).
        assert lookup or item is not None
        outcome = LATER if lookup or item.looking else answer_outcome(item.state)
        return Decision(Action.PROCEED, lookup=lookup, renew=renew, outcome=outcome)
