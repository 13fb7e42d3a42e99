"""The scheduler side's item state machine, its bounded table and the topology belief,
as units (no S3, no vLLM engine): every fetch result maps to one state, only the
transitions in the table happen, and the LRU bound never drops what a request holds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ec_s3.connector import items
from ec_s3.connector.items import (
    PRODUCER_CAPACITY,
    TRANSITIONS,
    IllegalTransition,
    Item,
    ItemState,
    ItemTable,
    RequestState,
    consumer_capacity,
)
from ec_s3.connector.topology import Topology, WorkerReach
from ec_s3.transfer.fetcher import Failed, Invalid, Missing, NoSpace, Present, Staged
from ec_s3.transfer.staging import StagingSlot


@pytest.fixture(autouse=True)
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(items, "STRICT", True)


def _looking(key: str = "k") -> Item:
    item = Item(key=key, identifier=f"id-{key}")
    item.start_lookup()
    return item


def _staged(name: str = "s") -> Staged:
    return Staged(slot=StagingSlot(name=name, path=f"/x/{name}", nbytes=10), data_offset=4, dtype="bfloat16", shape=(1, 3))


@pytest.mark.parametrize(("result", "state", "reason"), [
    (_staged(), ItemState.STAGED, ""),
    (Present(size=10), ItemState.PRESENT, ""),
    (Missing(), ItemState.MISSING, "not found"),
    (Invalid("bad magic"), ItemState.INVALID, "bad magic"),
    (Failed("503", transient=True, outage=True), ItemState.FAILED, "503"),
    (NoSpace(), ItemState.NO_SPACE, "staging area full"),
])
def test_every_fetch_result_maps_to_one_state(result: Any, state: ItemState, reason: str) -> None:
    item = _looking()
    item.apply(result, now=5.0)
    assert (item.state, item.reason, item.attempts, item.checked_at) == (state, reason, 1, 5.0)
    assert item.staged is (result if isinstance(result, Staged) else None)
    assert item.outage is isinstance(result, Failed)


_RESULTS = [
    (_staged(), ItemState.STAGED, "polls_hit", False),
    (Present(size=10), ItemState.PRESENT, "polls_hit", False),
    (Missing(), ItemState.MISSING, "polls_miss", False),
    (Invalid("bad magic"), ItemState.INVALID, None, False),
    (Failed("503", transient=True), ItemState.FAILED, "store_errors", True),
    (Failed("403"), ItemState.FAILED, "store_errors", False),
    (NoSpace(), ItemState.NO_SPACE, None, False),
]


@pytest.mark.parametrize(("result", "state", "counter", "transient"), _RESULTS)
def test_apply_returns_the_one_classification(result: Any, state: ItemState, counter: str | None,
                                              transient: bool) -> None:
    """The scheduler counts and logs from what apply classified, never from the class:
    apply's answer is the state it moved the item to, with that answer's counter."""
    item = _looking()
    outcome = item.apply(result, now=1.0)
    assert (outcome.state, outcome.counter, outcome.transient) == (state, counter, transient)
    assert item.state is outcome.state


def test_a_lookup_answers_exactly_the_answer_states() -> None:
    """``ANSWERS`` (what a LOOKING item may become) is what the fetch results map to:
    no answer state that no result reaches, no result that lands outside it."""
    assert {items.classify(result).state for result, *_ in _RESULTS} == items.ANSWERS


def test_illegal_transitions_raise_when_strict_and_are_logged_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    item = Item(key="k", identifier="i")
    with pytest.raises(IllegalTransition):
        item.apply(Missing(), now=1.0)  # a result without a lookup
    item.start_lookup()
    with pytest.raises(IllegalTransition):
        item.start_lookup()  # two lookups of one key at once
    with pytest.raises(IllegalTransition):
        item.drop()  # a lookup in flight must find its item
    item.apply(_staged(), now=1.0)
    with pytest.raises(IllegalTransition):
        item.start_lookup()  # staged items are dropped, then looked up as new items
    monkeypatch.setattr(items, "STRICT", False)
    item.apply(Missing(), now=2.0)  # logged and ignored
    assert item.state is ItemState.STAGED and item.attempts == 1


def test_transition_table_is_closed() -> None:
    assert set(TRANSITIONS) == set(ItemState)
    assert all(targets <= set(ItemState) for targets in TRANSITIONS.values())
    assert TRANSITIONS[ItemState.DROPPED] == frozenset()


def test_table_evicts_least_recently_used_but_never_what_is_held() -> None:
    table = ItemTable(capacity=4)
    held_slot = StagingSlot(name="live", path="/x/live", nbytes=10)
    request = SimpleNamespace(request_id="r1")
    state = RequestState(request=request, promises={})  # type: ignore[arg-type]

    used = table.add("used", "id-used")
    used.start_lookup()
    used.apply(Missing(), now=0.0)
    state.use("id-used", used)
    looking = table.add("looking", "id-looking")
    looking.start_lookup()
    staged = table.add("staged", "id-staged")
    staged.start_lookup()
    staged.apply(Staged(slot=held_slot, data_offset=0, dtype="bfloat16", shape=(1, 5)), now=0.0)
    for i in range(20):
        item = table.add(f"k{i}", f"id-{i}")
        item.start_lookup()
        item.apply(Missing(), now=0.0)
        table.point(f"id-{i}", item)
    assert len(table) == 4
    assert table.get("used") is used and table.get("looking") is looking and table.get("staged") is staged
    assert table.get("k19") is not None and table.get("k0") is None
    assert table.current("id-0") is None and table.current("id-19") is not None  # no dangling pointers
    assert len(table._current) <= len(table)

    # Released, finished, or its slot gone: evictable again.
    state.release()
    looking.apply(Missing(), now=0.0)
    held_slot.evicted = True
    for key in ("new1", "new2", "new3"):
        table.add(key, f"id-{key}").start_lookup()
    assert len(table) == 4 and {"used", "looking", "staged"}.isdisjoint(table._items)


def test_request_state_tracks_users_across_item_replacement() -> None:
    state = RequestState(request=SimpleNamespace(request_id="r1"), promises={})  # type: ignore[arg-type]
    first, second = Item(key="k", identifier="i"), Item(key="k", identifier="i")
    state.use("i", first)
    state.use("i", first)
    assert first.users == {"r1"}
    state.use("i", second)
    assert first.users == set() and second.users == {"r1"}
    state.release()
    assert second.users == set() and state.items == {}


def test_capacities() -> None:
    assert consumer_capacity(1 << 20) == 4096  # floor
    assert consumer_capacity(4 << 30) == 16384  # 4 GiB of staging / 256 KiB
    assert consumer_capacity(1 << 40) == 65536  # ceiling
    assert PRODUCER_CAPACITY == 4096


def _vllm_config(backend: Any, nnodes: int = 1, world_size: int = 1) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend=backend, nnodes_within_dp=nnodes, world_size=world_size))


@pytest.mark.parametrize(("backend", "nnodes", "reach"), [
    ("uni", 1, WorkerReach.LOCAL),
    ("mp", 1, WorkerReach.LOCAL),
    ("external_launcher", 1, WorkerReach.LOCAL),
    ("mp", 2, WorkerReach.REMOTE),
    ("ray", 1, WorkerReach.UNKNOWN),
    (object, 1, WorkerReach.UNKNOWN),  # a custom executor class
])
def test_topology_from_config(backend: Any, nnodes: int, reach: WorkerReach) -> None:
    assert Topology.from_vllm(_vllm_config(backend, nnodes, world_size=2), "h").reach is reach


def test_topology_learns_from_worker_reports() -> None:
    unknown = Topology(WorkerReach.UNKNOWN, "h")
    unknown.learn(set())
    assert unknown.reach is WorkerReach.UNKNOWN
    unknown.learn({"h"})
    assert unknown.workers_read_staging
    unknown.learn({"h", "other"})
    assert unknown.reach is WorkerReach.REMOTE
    unknown.learn({"h"})  # one remote worker is enough: it stays remote
    assert not unknown.workers_read_staging
    local = Topology(WorkerReach.LOCAL, "h")
    local.learn({"other"})  # the config was wrong: believe the worker
    assert local.reach is WorkerReach.REMOTE


def test_repeats_count_the_same_answer_in_a_row() -> None:
    """Back-offs count answers in a row, so another answer starts them over (before,
    an item's attempts never reset, and its back-off only grew over its life)."""
    item = Item(key="k", identifier="i")
    for n, result in enumerate([NoSpace(), NoSpace(), NoSpace()], start=1):
        item.start_lookup(now=float(n))
        assert item.started_at == float(n)
        item.apply(result, now=n + 0.5)
        assert item.repeats == n
    item.start_lookup(now=9.0)
    item.apply(Missing(), now=9.5)
    assert (item.repeats, item.attempts) == (1, 4)


@pytest.mark.parametrize(("wait_s", "max_gets"), [(0.1, 51), (1.0, 100), (5.0, 135), (30.0, 260)])
def test_promise_poll_schedule_cost_and_delay(wait_s: float, max_gets: int) -> None:
    """The poll schedule of a promised blob, with instant answers (the most GETs it can
    cost): <= 50 GETs in the first 100 ms, ~20 more per tenfold of the wait after that,
    and a blob that becomes visible is found within max(2 ms, 5% of the wait, 250 ms cap)."""
    from ec_s3.connector.admission import promise_poll_interval

    polls = [0.0]
    while polls[-1] < wait_s:
        polls.append(polls[-1] + promise_poll_interval(polls[-1]))
    assert len(polls) <= max_gets
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    assert all(gap <= max(0.002, 0.05 * at) + 1e-9 for at, gap in zip(polls, gaps))
    assert max(gaps) <= 0.25 and max(gaps[:50]) <= 0.002 + 1e-9
