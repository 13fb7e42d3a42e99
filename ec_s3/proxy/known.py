"""What the proxy knows is in the bucket: items an encoder answered for, or a HEAD found,
so that a repeat goes to prefill/decode marked present, with no encoder request.

Owns the table (bounded by ``max_entries``, ``max_bytes`` and ``ttl_s``; an encoder's
entry forwarded as its promise for ``settle_s``, then present) and the references (a
SHA-256 of what makes an item's blob key). Does not own sending anything, the HEAD itself
(:mod:`ec_s3.proxy.skips`) or when entries are used (:mod:`ec_s3.proxy.dispatch`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

from ec_s3.blob.format import PRESENT_MARK
from ec_s3.blob.keys import KeySpace
from ec_s3.proxy.media import ENCODER_CARRIED_FIELDS, MediaItem

__all__ = ["Known", "KnownBlobs", "item_ref", "keyspace_of"]

# Per entry beyond its JSON: the dict slots, the dataclass, the key strings.
_ENTRY_OVERHEAD_BYTES = 400


def item_ref(body: dict[str, Any], item: MediaItem) -> str:
    """The reference of ``item`` of ``body`` (module docstring)."""
    digest = hashlib.sha256()
    carried = {k: body[k] for k in ENCODER_CARRIED_FIELDS if k in body}
    digest.update(json.dumps(carried, sort_keys=True, separators=(",", ":"), default=str).encode())
    digest.update(b"\0")
    name = item.part.get("uuid")
    digest.update((name if isinstance(name, str) else item.part_json or json.dumps(item.part)).encode(
        "utf-8", "surrogatepass"))
    return digest.hexdigest()


def keyspace_of(key: str, prefix: str) -> KeySpace | None:
    """The key space (``<prefix>/<namespace>/``) a blob key of an encoder's answer lives
    in, if it is one under ``prefix``: lets a HEAD derive the keys of other items."""
    head = prefix.strip("/") + "/"
    if not isinstance(key, str) or not key.startswith(head):
        return None
    namespace = key[len(head):].split("/", 1)[0]
    if not namespace or namespace.startswith("t-"):
        return None
    space = KeySpace(prefix, namespace)
    return space if space.owns(key) else None


@dataclasses.dataclass
class Known:
    """One item the proxy knows is (or is about to be) in the bucket."""

    key: str  # the blob's key: what a consumer's missing report names
    identifier: str  # what the forwarded entry is keyed by
    # The encoder's ec_transfer_params entry; None: a HEAD found it.
    entry: dict[str, Any] | None
    learned_at: float
    present_at: float  # from then on it is marked present
    nbytes: int
    source: str  # "answer" or "bucket"
    # A HEAD's find: the placeholder metadata stored with the blob ({"modality",
    # "metadata"}), which lets the item go to prefill/decode metadata-only.
    placeholder: dict[str, Any] | None = None

    def params(self, indices: list[int], now: float) -> dict[str, Any]:
        """The ``ec_transfer_params`` entry for a request in which it occurs at ``indices``."""
        if self.entry is None:
            return {self.identifier: {**(self.placeholder or {}), PRESENT_MARK: True, "item_indices": list(indices)}}
        entry = {**self.entry, "item_indices": list(indices)}
        if now >= self.present_at:
            entry[PRESENT_MARK] = True
        return {self.identifier: entry}


class KnownBlobs:
    """The bounded table of :class:`Known` items, by reference; one event loop, no locks."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float, settle_s: float) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self._by_ref: collections.OrderedDict[str, Known] = collections.OrderedDict()
        self._refs_by_key: dict[str, set[str]] = {}
        self.nbytes = 0
        # Why entries went, since start (the caller turns them into metrics).
        self.forgotten: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._by_ref)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def get(self, ref: str, now: float | None = None) -> Known | None:
        known = self._by_ref.get(ref)
        if known is None:
            return None
        now = time.monotonic() if now is None else now
        if now - known.learned_at > self.ttl_s:
            self._drop(ref, "expired")
            return None
        self._by_ref.move_to_end(ref)
        return known

    def remember_answer(self, ref: str, params: dict[str, Any], now: float | None = None) -> bool:
        """Record an encoder's answer for the item ``ref`` (its ``ec_transfer_params``: one
        identifier, for one item); False when it promises no blob (no key)."""
        entries = [(i, e) for i, e in params.items() if isinstance(e, dict) and isinstance(e.get("key"), str)]
        if len(entries) != 1:
            return False
        identifier, entry = entries[0]
        now = time.monotonic() if now is None else now
        self._add(ref, Known(entry["key"], identifier, dict(entry), now, now + self.settle_s,
                             _size(identifier, entry), "answer"))
        return True

    def remember_present(self, ref: str, key: str, identifier: str, now: float | None = None,
                         placeholder: dict[str, Any] | None = None) -> None:
        """Record that a HEAD found the blob at ``key`` of the item named ``identifier``
        (with the ``placeholder`` metadata stored with it, if any)."""
        now = time.monotonic() if now is None else now
        size = _size(identifier, {"key": key, **(placeholder or {})})
        self._add(ref, Known(key, identifier, None, now, now, size, "bucket", placeholder))

    def forget_keys(self, keys: Iterable[object], reason: str = "missing") -> int:
        """Forget every entry of these blob keys (a consumer found them missing)."""
        n = 0
        for key in keys:
            for ref in list(self._refs_by_key.get(key, ())) if isinstance(key, str) else ():
                self._drop(ref, reason)
                n += 1
        return n

    def forget_ref(self, ref: str, reason: str) -> bool:
        """Forget the entry of item ``ref``, if any (its blob failed a consumer)."""
        if ref not in self._by_ref:
            return False
        self._drop(ref, reason)
        return True

    def _add(self, ref: str, known: Known) -> None:
        if not self.enabled or known.nbytes > self.max_bytes:
            return
        if ref in self._by_ref:
            self._drop(ref, None)
        self._by_ref[ref] = known
        self._refs_by_key.setdefault(known.key, set()).add(ref)
        self.nbytes += known.nbytes
        while len(self._by_ref) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._by_ref)), "evicted")

    def _drop(self, ref: str, reason: str | None) -> None:
        known = self._by_ref.pop(ref)
        self.nbytes -= known.nbytes
        refs = self._refs_by_key.get(known.key)
        if refs is not None:
            refs.discard(ref)
            if not refs:
                del self._refs_by_key[known.key]
        if reason is not None:
            self.forgotten[reason] += 1


def _size(identifier: str, entry: dict[str, Any]) -> int:
    try:
        text = json.dumps(entry, default=str)
    except (TypeError, ValueError, RecursionError):
        text = ""
    return _ENTRY_OVERHEAD_BYTES + 64 + len(identifier) + len(text)
