"""A consumer's pins on staged blobs, by request: the hold-and-wait rule.

A request pins a slot only while it will read it, and a request deferred for a blob pins
none while it waits unless it is the senior (the oldest waiting): so staging never fills
with first items whose requests wait for their second ones. Owns pinning, unpinning and
the rules' check. Does not own staging (:mod:`ec_s3.transfer.staging`) nor seniority.
"""

from __future__ import annotations

from collections.abc import Mapping

from ec_s3.connector.items import Item, RequestState
from ec_s3.transfer.staging import StagingArea

__all__ = ["StagingPins"]


class StagingPins:
    """``staging`` None (a producer): nothing is staged, every hold succeeds."""

    def __init__(self, staging: StagingArea | None) -> None:
        self._staging = staging

    def hold(self, state: RequestState, identifier: str, item: Item) -> bool:
        """Pin ``item``'s slot for this request; False if staging evicted it meanwhile
        (the caller forgets the item)."""
        if self._staging is None:
            return True  # a producer's hit is in the bucket: nothing here to hold
        slot = item.slot
        assert slot is not None
        pinned = state.pins.get(identifier)
        if pinned is slot and not slot.evicted:
            return True
        if pinned is not None:  # evicted, or a slot of an earlier lookup of this item
            self._staging.unpin(state.pins.pop(identifier))
        if self._staging.pin(slot):
            state.pins[identifier] = slot
            return True
        return False

    def unuse(self, state: RequestState, identifier: str) -> None:
        """The request will not read ``identifier``'s item (encoded locally, freed, or
        failing): it stops using it and unpins its slot."""
        slot = state.pins.pop(identifier, None)
        if slot is not None and self._staging is not None:
            self._staging.unpin(slot)
        state.forget(identifier)

    def release_all(self, state: RequestState) -> None:
        """Unpin every slot of ``state``'s request (it waits, or it is done)."""
        if self._staging is not None:
            for slot in state.pins.values():
                self._staging.unpin(slot)
        state.pins.clear()

    def violations(self, requests: Mapping[str, RequestState]) -> list[str]:
        """Broken rules: no pinned slot is free (evicted or discarded); no pin by a
        request that will not read the slot (it encodes the item itself, vLLM freed it,
        or the slot is not its item's); a slot's pin count is its requests' pins; staged
        bytes in use are the live slots' bytes."""
        if self._staging is None:
            return []
        out = self._staging.violations()
        counts: dict[int, int] = {}
        for req_id, state in requests.items():
            for identifier, slot in state.pins.items():
                counts[id(slot)] = counts.get(id(slot), 0) + 1
                item = state.items.get(identifier)
                if slot.evicted:
                    out.append(f"request {req_id} pins the free slot {slot.name} ({identifier[:32]})")
                if identifier in state.local:
                    out.append(f"request {req_id} pins {identifier[:32]}, which it encodes itself")
                if item is None or item.slot is not slot:
                    out.append(f"request {req_id} pins a slot of {identifier[:32]} that is not its item's")
        for slot in self._staging.slots():
            if slot.pins != counts.get(id(slot), 0):
                out.append(f"slot {slot.name} has {slot.pins} pins, its requests hold {counts.get(id(slot), 0)}")
        return out
