"""Admission state of the scheduler side: one :class:`Item` per key in the bucket, one
:class:`RequestState` per request, and the bounded table that holds the items.

Owns the item state machine (states, the transition table, :func:`classify`), the LRU
bound, and what one request holds while admitted. Does not own when to look up, retry
or give up (:mod:`ec_s3.connector.admission`), what to answer vLLM
(:mod:`ec_s3.connector.scheduler`), running lookups or staging memory.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ec_s3.log import logger
from ec_s3.transfer.fetcher import Failed, FetchResult, Invalid, Missing, NoSpace, Present, Staged

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ec_s3.connector.transfer_params import Promise
    from ec_s3.transfer.staging import StagingSlot

__all__ = [
    "ANSWERS",
    "IllegalTransition",
    "Item",
    "ItemState",
    "ItemTable",
    "Outcome",
    "RETRYABLE",
    "RequestState",
    "TRANSITIONS",
    "classify",
    "consumer_capacity",
    "PRODUCER_CAPACITY",
]

# Raise on an illegal transition instead of logging it. The test harness turns it on;
# in an engine a bookkeeping slip must not take the engine down.
STRICT = False


class ItemState(enum.Enum):
    NEW = "new"  # created, its first lookup not started yet
    LOOKING = "looking"  # a lookup runs on the I/O loop
    STAGED = "staged"  # consumer: fetched into staging and validated
    PRESENT = "present"  # producer: the bucket has it (HEAD)
    MISSING = "missing"
    INVALID = "invalid"  # fetched, failed validation
    FAILED = "failed"  # the store failed (``Item.outage``: it is down)
    NO_SPACE = "no_space"  # staging had no room for it
    DROPPED = "dropped"  # forgotten: evicted, or its staging slot is gone


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A finished lookup, classified: what the item and the scheduler need of it."""

    state: ItemState
    counter: str | None = None  # the scheduler's counter for this answer
    reason: str = ""
    staged: Staged | None = None  # the validated blob in staging (consumers)
    outage: bool = False  # the store is down, not just this request
    transient: bool = False  # a failure that may pass (throttling, 5xx, timeouts)


def classify(result: FetchResult) -> Outcome:
    """The one place a fetch result's class is looked at."""
    match result:
        case Staged():
            return Outcome(ItemState.STAGED, "polls_hit", staged=result)
        case Present():
            return Outcome(ItemState.PRESENT, "polls_hit")
        case Missing():  # one per 404, polls of a promise included (a request's outcome is not: lookups_*)
            return Outcome(ItemState.MISSING, "polls_miss", "not found")
        case Invalid():
            return Outcome(ItemState.INVALID, None, result.reason)
        case Failed():
            return Outcome(ItemState.FAILED, "store_errors", result.reason, outage=result.outage, transient=result.transient)
        case NoSpace():
            return Outcome(ItemState.NO_SPACE, None, "staging area full")
    raise TypeError(f"not a fetch result: {result!r}")


# What a lookup can answer.
ANSWERS = frozenset({
    ItemState.STAGED, ItemState.PRESENT, ItemState.MISSING, ItemState.INVALID, ItemState.FAILED, ItemState.NO_SPACE,
})
RETRYABLE = frozenset({ItemState.MISSING, ItemState.INVALID, ItemState.FAILED, ItemState.NO_SPACE})

_S = ItemState
TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    _S.NEW: frozenset({_S.LOOKING}),
    # A lookup in flight is never dropped: its result must find the item (and a
    # staged slot it brings is released through the item).
    _S.LOOKING: ANSWERS,
    _S.STAGED: frozenset({_S.DROPPED}),  # slot evicted or unreadable: look up again as a new item
    _S.PRESENT: frozenset({_S.DROPPED}),
    **{s: frozenset({_S.LOOKING, _S.DROPPED}) for s in RETRYABLE},
    _S.DROPPED: frozenset(),
}


class IllegalTransition(AssertionError):
    """A transition not in :data:`TRANSITIONS` (a bookkeeping bug)."""


@dataclasses.dataclass(eq=False)
class Item:
    """One key in the bucket, as far as this scheduler knows it."""

    key: str
    identifier: str
    state: ItemState = ItemState.NEW
    started_at: float = 0.0  # when the last lookup started
    checked_at: float = 0.0  # when the last lookup finished
    attempts: int = 0  # finished lookups, over the item's whole life (for log throttling)
    # Finished lookups in a row with the same answer: back-offs count these, so one
    # success (or another answer) starts them over.
    repeats: int = 0
    reason: str = ""
    staged: Staged | None = None
    outage: bool = False  # the last lookup failed because the store is down
    # Ids of live requests that admitted this item: never evicted while there are any.
    users: set[str] = dataclasses.field(default_factory=set)
    # Ids of requests that went on without waiting for the running lookup: its answer
    # is their lookup's outcome (counted when it comes).
    unawaited: set[str] = dataclasses.field(default_factory=set)
    _last: ItemState | None = dataclasses.field(default=None, repr=False)  # the last lookup's answer

    def _move(self, to: ItemState) -> bool:
        if to in TRANSITIONS[self.state]:
            self.state = to
            return True
        message = f"ec-s3: illegal item transition {self.state.value} -> {to.value} for {self.key}"
        if STRICT:
            raise IllegalTransition(message)
        logger.error("%s; ignored", message)
        return False

    def start_lookup(self, now: float = 0.0) -> None:
        if self._move(ItemState.LOOKING):
            self.started_at = now

    def apply(self, result: FetchResult, now: float) -> Outcome:
        """Record a finished lookup; its classification, for the caller's counters."""
        outcome = classify(result)
        to = outcome.state
        if self._move(to):
            self.repeats = self.repeats + 1 if to is self._last else 1
            self._last = to
            self.checked_at, self.attempts = now, self.attempts + 1
            self.staged, self.outage, self.reason = outcome.staged, outcome.outage, outcome.reason
        return outcome

    def drop(self) -> None:
        if self.state is not ItemState.DROPPED:
            self._move(ItemState.DROPPED)

    @property
    def looking(self) -> bool:
        return self.state is ItemState.LOOKING

    @property
    def slot(self) -> StagingSlot | None:
        return self.staged.slot if self.staged is not None else None


# Producers remember PRESENT answers and misses only to save HEADs: a fixed count.
PRODUCER_CAPACITY = 4096
# Consumers: at least as many entries as staging holds blobs of a modest size, so the
# table never forgets a staged blob sooner than staging would evict it.
_CONSUMER_MIN_CAPACITY = 4096
_CONSUMER_BYTES_PER_ENTRY = 256 * 1024  # a small image: 64 tokens x 2048 wide x bf16
_CONSUMER_MAX_CAPACITY = 65536  # ~1 KB each: at most ~64 MB of bookkeeping


def consumer_capacity(staging_bytes: int) -> int:
    return min(_CONSUMER_MAX_CAPACITY, max(_CONSUMER_MIN_CAPACITY, staging_bytes // _CONSUMER_BYTES_PER_ENTRY))


class ItemTable:
    """Items by key, least recently used first, bounded to ``capacity`` entries.

    Never evicted: items in use by a live request (``users``), lookups in flight, and
    staged items whose slot is still in staging (forgetting one would orphan the slot
    under its name until staging evicts it). Beyond ``capacity`` the table therefore
    holds only those; staging's byte bound and vLLM's request limit bound them.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, Item] = collections.OrderedDict()
        # identifier -> the item last admitted for it: has_cache_item gets only the
        # identifier, and asks right after ensure_cache_available admitted it.
        self._current: dict[str, Item] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(list(self._items.values()))

    def __getitem__(self, key: str) -> Item:
        return self._items[key]

    def get(self, key: str) -> Item | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def peek(self, key: str) -> Item | None:
        """The item for ``key``, without marking it used."""
        return self._items.get(key)

    def current(self, identifier: str) -> Item | None:
        item = self._current.get(identifier)
        return item if item is not None and item.state is not ItemState.DROPPED else None

    def point(self, identifier: str, item: Item | None) -> None:
        if item is None:
            self._current.pop(identifier, None)
        else:
            self._current[identifier] = item

    def add(self, key: str, identifier: str) -> Item:
        item = Item(key=key, identifier=identifier)
        old = self._items.pop(key, None)
        if old is not None:
            self._forget(old)
        self._items[key] = item
        if len(self._items) > self.capacity:
            self._evict()
        return item

    def drop(self, item: Item) -> None:
        """Forget ``item`` now (its staging slot is gone or unusable)."""
        if self._items.get(item.key) is item:
            del self._items[item.key]
        self._forget(item)

    def _forget(self, item: Item) -> None:
        item.drop()
        if self._current.get(item.identifier) is item:
            del self._current[item.identifier]

    def _evictable(self, item: Item) -> bool:
        if item.users or item.state in (ItemState.NEW, ItemState.LOOKING):
            return False
        slot = item.slot
        return slot is None or slot.evicted

    def _evict(self) -> None:
        excess = len(self._items) - self.capacity
        victims = []
        for item in self._items.values():  # least recently used first
            if self._evictable(item):
                victims.append(item)
                if len(victims) >= excess:
                    break
        for item in victims:
            self.drop(item)
        self.evicted += len(victims)


@dataclasses.dataclass(eq=False)
class RequestState:
    """What one admitted request holds, from its first ``ensure_cache_available``
    to ``request_finished``."""

    request: Request
    promises: dict[str, Promise]
    # identifier -> first deferred at; it gives up at that plus its wait budget
    waiting_since: dict[str, float] = dataclasses.field(default_factory=dict)
    local: set[str] = dataclasses.field(default_factory=set)  # identifiers vLLM encodes itself
    pins: dict[str, StagingSlot] = dataclasses.field(default_factory=dict)  # identifier -> pinned slot
    items: dict[str, Item] = dataclasses.field(default_factory=dict)  # identifier -> item it uses
    # Keys of items marked present that the bucket did not have: reported in the answer.
    gone: set[str] = dataclasses.field(default_factory=set)
    decided: set[str] = dataclasses.field(default_factory=set)  # identifiers whose lookup outcome is counted
    saved: set[str] = dataclasses.field(default_factory=set)  # producer: identifiers published (or found) under its key

    def forget(self, identifier: str) -> None:
        """The request will not read ``identifier``'s item (any more)."""
        old = self.items.pop(identifier, None)
        if old is not None:
            old.users.discard(self.request.request_id)

    def use(self, identifier: str, item: Item) -> None:
        old = self.items.get(identifier)
        if old is item:
            return
        if old is not None:
            old.users.discard(self.request.request_id)
        item.users.add(self.request.request_id)
        self.items[identifier] = item

    def release(self) -> None:
        for item in self.items.values():
            item.users.discard(self.request.request_id)
        self.items.clear()
