"""Cache-affinity routing: which prefill/decode instance a request with media should go to.

Pure functions, no I/O. Owns the ranking (rendezvous hashing of the first media item's
identifier over the healthy instances), the bound (an instance takes a request only while
its load stays within ``ceil((1 + balance) * m / n)``, else the next in order: a spill)
and the routing key of a request. Does not own loads or health (:mod:`.upstreams` counts
them) nor least-loaded choice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

from ec_s3.proxy.media import MediaItem, media_key
from ec_s3.proxy.naming import content_uuid

__all__ = ["AFFINITY", "LEAST_LOADED", "ROUTES", "Pick", "bounded_pick", "rendezvous_order", "route_key"]

LEAST_LOADED = "least-loaded"
AFFINITY = "affinity"
ROUTES = (LEAST_LOADED, AFFINITY)


@dataclasses.dataclass(frozen=True)
class Pick:
    """The chosen candidate's index, and whether it was the key's first choice."""

    index: int
    spilled: bool


def _weight(key: str, name: str) -> int:
    # blake2b, not hash(): the ranking must agree across processes (PYTHONHASHSEED) and
    # across the proxies of one fleet.
    digest = hashlib.blake2b(digest_size=8)
    digest.update(name.encode("utf-8", "surrogatepass"))
    digest.update(b"\n")
    digest.update(key.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest(), "big")


def rendezvous_order(key: str, names: Sequence[str]) -> list[int]:
    """Indices of ``names`` from the key's first choice to its last (ties, which a 64-bit
    weight makes vanishingly rare, by name so the order never depends on list order)."""
    return sorted(range(len(names)), key=lambda i: (-_weight(key, names[i]), names[i]))


def bounded_pick(key: str, names: Sequence[str], loads: Sequence[int], balance: float) -> Pick:
    """The first candidate in ``key``'s rendezvous order whose load, with this request,
    stays within ``ceil((1 + balance) * m / n)`` (``m``: the loads' sum plus one).
    ``names`` and ``loads`` describe the same non-empty list of candidates."""
    if not names or len(names) != len(loads):
        raise ValueError("bounded_pick: needs one load per candidate, and at least one candidate")
    bound = math.ceil((1.0 + balance) * (sum(loads) + 1) / len(names))
    order = rendezvous_order(key, names)
    for rank, index in enumerate(order):
        if loads[index] + 1 <= bound:
            return Pick(index, spilled=rank > 0)
    # Unreachable with non-negative loads (module docstring); a negative load is a bug upstream.
    raise AssertionError(f"bounded_pick: no candidate within bound {bound} for loads {list(loads)}")


def route_key(items: Sequence[MediaItem]) -> str | None:
    """What a request is routed by: its first media item's content identifier (its proxy
    ``uuid`` when named, else computed the same way), None without media."""
    if not items:
        return None
    part = items[0].part
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return uuid
    field = media_key(part)
    return content_uuid(field, part[field]) if field is not None else items[0].part_json
