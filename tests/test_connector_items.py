"""The scheduler side's item state machine as a unit (no S3, no vLLM engine): every
fetch result maps to one state, and only the transitions in the table happen."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ec_s3.connector import items
from ec_s3.connector.items import TRANSITIONS, IllegalTransition, Item, ItemState, RequestState
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
