"""``ec_transfer_params``, both ways: what a producer returns for a finished request, and
what a consumer accepts of them.

Owns the format of an ec-s3 entry (vLLM's per-item metadata plus ``key``, ``dtype``,
``shape``, ``size_bytes``, and the proxy's pending/present marks and ``ec_s3_namespace``)
and its checks: the params are untrusted, so an entry is a promise only for the key this
consumer derives itself, in its own namespace. Does not own when a promise is waited
for (:mod:`ec_s3.connector.scheduler`), keys or the blob layout. Details: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

from ec_s3.blob.codec import BlobLayout, BlobMeta
from ec_s3.blob.format import BLOB_NAME_RE, NAMESPACE_FIELD, PENDING_MARK, PRESENT_MARK, PROBE_FIELD
from ec_s3.connector.model import ModelInfo
from ec_s3.log import logger
from ec_s3.transfer.counters import Counters

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

__all__ = [
    "FOREIGN_WARN_INTERVAL_S",
    "Promise",
    "build_transfer_params",
    "check_promise",
    "foreign_location",
    "pending_features",
    "probe_answer",
    "read_promises",
]

#: A fleet configured inconsistently sends every request's entries to the wrong place:
#: one warning per (their location, ours) per this many seconds, with the count held back.
FOREIGN_WARN_INTERVAL_S = 60.0
_foreign_lock = threading.Lock()
_foreign_warned: dict[tuple[str, str], tuple[float, int]] = {}


@dataclasses.dataclass(frozen=True)
class Promise:
    """What a producer's ``ec_transfer_params`` say about one item, once checked."""

    key: str
    size_bytes: int | None
    # Marked present: the blob was in the bucket when the proxy sent the request, so a
    # miss means it was deleted since (nothing will upload it): encode it at once.
    present: bool = False


def build_transfer_params(
    request: Request, model: ModelInfo, resolver: PlaceholderMetadataResolver, *, promise: bool = True,
    withhold: set[str] | frozenset[str] = frozenset(),
) -> dict[str, dict[str, Any]]:
    """Producer: vLLM's per-item metadata plus what a consumer needs to fetch and check
    each blob: key, dtype, shape and the blob's size in bytes. With ``promise=False``
    (the producer knows it cannot upload now) only vLLM's metadata is sent: a key is a
    promise, and a consumer waits up to ``promised_wait_s`` for a promised blob. Items
    in ``withhold`` get no promise either (nothing is published under their key)."""
    items = collect_ec_item_metadata(request.mm_features, resolver)
    dtype = model.dtype
    for identifier, entry in items.items():
        feature = request.mm_features[entry["item_indices"][0]]
        entry.setdefault("modality", feature.modality)  # vLLM 0.32 omits it; 0.33 adds it
        entry[NAMESPACE_FIELD] = model.location
        if not promise or identifier in withhold:
            continue
        entry["key"] = model.keyspace.key_for(identifier, cache_salt=request.cache_salt)
        entry["dtype"] = str(dtype).removeprefix("torch.")
        width = model.width_for(feature.modality)
        if width is not None:
            shape = (feature.mm_position.get_num_embeds(), width)
            entry["shape"] = list(shape)
            layout = BlobLayout.plan(BlobMeta(identifier, dtype, shape, model.keyspace.namespace, model.engine_id))
            entry["size_bytes"] = layout.total_nbytes
    return items


def read_promises(request: Request, model: ModelInfo, max_blob_bytes: int, counters: Counters) -> dict[str, Promise]:
    """Consumer: the checked promises of ``request.ec_transfer_params``. Anything
    malformed or pointing outside this namespace is ignored, with one warning per
    request; entries without a ``key`` belong to someone else and are skipped quietly."""
    raw = getattr(request, "ec_transfer_params", None)
    if raw is not None and not isinstance(raw, dict):
        logger.warning("ec-s3: request %s: ignoring ec_transfer_params of type %s", request.request_id, type(raw).__name__)
        raw = None
    features = {f.identifier: f for f in request.mm_features}
    promises: dict[str, Promise] = {}
    problems: list[str] = []
    foreign: dict[str, int] = {}  # their location -> entries refused for it
    for identifier, entry in (raw or {}).items():
        elsewhere = foreign_location(entry, model)
        if elsewhere:
            foreign[elsewhere] = foreign.get(elsewhere, 0) + 1
            continue
        present = isinstance(entry, dict) and entry.get(PRESENT_MARK) is True
        if isinstance(entry, dict) and (entry.get(PENDING_MARK) is True or (present and "key" not in entry)):
            for feature in pending_features(request, identifier, entry):
                key = model.keyspace.key_for(feature.identifier, cache_salt=request.cache_salt)
                promises.setdefault(feature.identifier, Promise(key=key, size_bytes=None, present=present))
            continue
        if not isinstance(entry, dict) or "key" not in entry:
            continue  # not an ec-s3 promise (another connector's, or metadata only)
        feature = features.get(identifier) if isinstance(identifier, str) else None
        problem = check_promise(request, feature, entry, model, max_blob_bytes)
        if problem:
            problems.append(f"{str(identifier)[:32]!r}: {problem}")
            continue
        size = entry.get("size_bytes")
        promises[identifier] = Promise(key=entry["key"], size_bytes=size if isinstance(size, int) else None,
                                       present=present)
    if foreign:
        counters.inc("promises_foreign", sum(foreign.values()))
        counters.inc("promises_ignored", sum(foreign.values()))
        for theirs, count in foreign.items():
            _warn_foreign(request.request_id, theirs, model.location, count)
    if problems:
        counters.inc("promises_ignored", len(problems))
        logger.warning(
            "ec-s3: request %s: ignoring invalid ec_transfer_params entries: %s",
            request.request_id, "; ".join(problems[:5]),
        )
    return promises


def foreign_location(entry: object, model: ModelInfo) -> str:
    """Where ``entry`` says its blob is published, when that is not this consumer's
    location ("" when it is, or the entry does not say): its ``ec_s3_namespace``, else the
    ``<prefix>/<namespace>/`` of its key when that key is a blob key under another root."""
    if not isinstance(entry, dict):
        return ""
    named = entry.get(NAMESPACE_FIELD)
    if isinstance(named, str):
        return "" if named == model.location else named[:512]
    key = entry.get("key")
    if isinstance(key, str) and not key.startswith(model.keyspace.root):
        parts = key.rsplit("/", 2)
        name = "/".join(parts[-2:]) if len(parts) == 3 and parts[-2].startswith("t-") else parts[-1]
        if BLOB_NAME_RE.fullmatch(name):
            return key[: len(key) - len(name)][:512]  # "<prefix>/<namespace>/" of an older producer
    return ""


def _warn_foreign(request_id: str, theirs: str, ours: str, count: int) -> None:
    now = time.monotonic()
    with _foreign_lock:
        last, held = _foreign_warned.get((theirs, ours), (float("-inf"), 0))
        if now - last < FOREIGN_WARN_INTERVAL_S:
            _foreign_warned[(theirs, ours)] = (last, held + 1)
            return
        _foreign_warned[(theirs, ours)] = (now, 0)
        if len(_foreign_warned) > 256:
            del _foreign_warned[next(iter(_foreign_warned))]
    logger.warning(
        "ec-s3: request %s: refusing %d ec_transfer_params entr%s for %s: this consumer reads %s. The "
        "producer (or the proxy's mark) publishes elsewhere: another bucket, prefix or model path "
        "(namespace) than this consumer's; its items are treated as not promised, not waited for. Give "
        "producers and consumers the same bucket, prefix and model path.%s",
        request_id, count, "y" if count == 1 else "ies", theirs, ours,
        f" ({held} similar requests since the last warning)" if held else "",
    )


def probe_answer(request: Request, role: str, model: ModelInfo) -> dict[str, Any]:
    """The answer to ``ec-s3 proxy``'s start-up probe (``PROBE_FIELD`` in the request's
    params): this server's EC role and where its blobs live; {} for any other request."""
    raw = getattr(request, "ec_transfer_params", None)
    if not isinstance(raw, dict) or PROBE_FIELD not in raw:
        return {}
    return {PROBE_FIELD: {"role": role, "namespace": model.location}}


def pending_features(request: Request, identifier: object, entry: dict[str, Any]) -> list[MultiModalFeatureSpec]:
    """The items a pending mark (``ec_s3 proxy``'s parallel dispatch: an encoder is
    encoding them now) stands for: the item whose identifier is the mark's, else those
    at its ``item_indices`` (an identifier hashed with processor kwargs is not the
    ``uuid`` the proxy set). The mark is untrusted, and needs no check: the key is this
    consumer's own, so a false mark costs at most ``promised_wait_s`` of waiting."""
    features = request.mm_features
    same = [f for f in features if f.identifier == identifier]
    if same:
        return same[:1]
    indices = entry.get("item_indices")
    if not isinstance(indices, list):
        return []
    return [features[i] for i in indices[: len(features)] if type(i) is int and 0 <= i < len(features)]


def check_promise(
    request: Request, feature: MultiModalFeatureSpec | None, entry: dict[str, Any], model: ModelInfo, max_blob_bytes: int
) -> str:
    """Why ``entry`` cannot be a promise for ``feature`` of ``request`` ("" if it can)."""
    if feature is None:
        return "no such item in the request"
    key = entry.get("key")
    if key != model.keyspace.key_for(feature.identifier, cache_salt=request.cache_salt):
        return "key is not this item's key in this namespace (producer uses another model, prefix or namespace?)"
    shape = entry.get("shape")
    if shape is not None:
        rows, width = feature.mm_position.get_num_embeds(), model.width_for(feature.modality)
        if (
            not isinstance(shape, list) or len(shape) != 2 or not all(type(d) is int for d in shape)
            or shape[0] != rows or (width is not None and shape[1] != width)
        ):
            return f"shape {shape!r} does not match ({rows}, {width})"
    dtype = entry.get("dtype")
    if dtype is not None and dtype != str(model.dtype).removeprefix("torch."):
        return f"dtype {dtype!r} is not the model's"
    size = entry.get("size_bytes")
    if size is not None and (type(size) is not int or not 0 < size <= max_blob_bytes):
        return "size_bytes out of range"
    return ""
