"""The proxy names media itself: content identifiers set as each part's ``uuid``, and
the pending marks of parallel dispatch. Pure functions, no I/O.

Owns naming (``ecs3-`` + SHA-256 of a part's media field and value; a client's ``uuid``
replaced or namespaced, never passed on as is), refusing an untrusted client's
metadata-only part (:class:`ClientMetadataOnly`, a 400) and the pending marks. Does not
own finding items (:mod:`.media`) or sending.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from typing import Any

from ec_s3.blob.format import NAMESPACE_FIELD, PENDING_MARK
from ec_s3.proxy.media import (
    EMBED_PART_TYPES,
    BodyError,
    MediaItem,
    TooDeeplyNested,
    TooManyItems,
    parts_of,
)

__all__ = [
    "CLIENT_PREFIX", "CONTENT_PREFIX", "ClientMetadataOnly", "content_uuid", "is_metadata_only", "name_media",
    "pending_params",
]

CONTENT_PREFIX = "ecs3-"
CLIENT_PREFIX = "client-"
# Fields of an image_url value that vLLM does not read: a part differing only in them
# is the same image, so it gets the same name.
_IGNORED_URL_FIELDS = frozenset({"url", "detail"})


def content_uuid(key: str, value: Any) -> str:
    """The content identifier of media ``value`` held in field ``key`` of a part."""
    if isinstance(value, dict) and isinstance(value.get("url"), str) and set(value) <= _IGNORED_URL_FIELDS:
        basis = value["url"]
    elif isinstance(value, str):
        basis = value
    else:
        try:
            basis = json.dumps(value, sort_keys=True, separators=(",", ":"))
        except RecursionError:
            raise TooDeeplyNested() from None
    digest = hashlib.sha256(key.encode())
    digest.update(b"\n")
    digest.update(basis.encode("utf-8", "surrogatepass"))
    return CONTENT_PREFIX + digest.hexdigest()


class ClientMetadataOnly(BodyError):
    """A client sent a metadata-only part and the proxy does not trust its clients."""

    def __init__(self, part_type: str) -> None:
        super().__init__(
            f"a {part_type} part without embeddings (placeholder metadata only) refers to an item in the servers' "
            "cache, which clients of this server may not do: send the media itself, or the embeddings"
        )


def is_metadata_only(part: dict[str, Any]) -> bool:
    """Whether ``part`` is an embeddings part that carries no tensor: its value is a
    non-empty object of plain JSON values only (vLLM sends tensors as base64 strings;
    placeholder metadata such as ``image_grid_thw`` as arrays of numbers). A part with no
    value at all is the servers' to refuse (vLLM answers 400: nothing sizes it)."""
    part_type = part.get("type")
    if not isinstance(part_type, str) or part_type not in EMBED_PART_TYPES:
        return False
    value = part.get(part_type)
    return isinstance(value, dict) and bool(value) and not any(isinstance(v, str) for v in value.values())


def _client_uuid(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return CLIENT_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def name_media(
    body: dict[str, Any], *, give_uuids: bool, limit: int | None = None, trust_embeds: bool = False
) -> dict[str, Any]:
    """``body`` with every media part named: parts carrying media get their content
    identifier as ``uuid`` (all of them with ``give_uuids``, else only those that came
    with a client's ``uuid``, which is replaced); media-less parts and embeddings parts
    with a client ``uuid`` get it namespaced, unless ``trust_embeds`` (embeddings parts
    keep theirs). A metadata-only part raises :class:`ClientMetadataOnly` unless
    ``trust_embeds``. The input is not modified; untouched messages are shared.

    More than ``limit`` parts with media raises :class:`TooManyItems` before anything is
    hashed, so a hostile list costs a scan.
    """
    if limit is not None:
        count = sum(1 for _, part, key in parts_of(body) if key is not None and part.get(key) not in (None, "", {}))
        if count > limit:
            raise TooManyItems(count, limit)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    renamed: dict[int, dict[str, Any]] = {}  # id(part) -> its named copy
    for _, part, key in parts_of(body):
        if key is None:
            part_type = part.get("type")
            if isinstance(part_type, str) and part_type in EMBED_PART_TYPES and not trust_embeds:
                if is_metadata_only(part):
                    raise ClientMetadataOnly(part_type)
                if part.get("uuid") is not None:
                    renamed[id(part)] = {**part, "uuid": _client_uuid(part["uuid"])}
            continue
        has_media = part.get(key) not in (None, "", {})
        if has_media and (give_uuids or part.get("uuid") is not None):
            renamed[id(part)] = {**part, "uuid": content_uuid(key, part[key])}
        elif not has_media and part.get("uuid") is not None:
            renamed[id(part)] = {**part, "uuid": _client_uuid(part["uuid"])}
    if not renamed:
        return body
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(id(p) in renamed for p in content):
            message = {**message, "content": [renamed.get(id(p), p) for p in content]}
        out.append(message)
    return {**body, "messages": out}


def pending_params(items: Sequence[MediaItem], marked: Collection[int], namespace: str | None = None) -> dict[str, Any]:
    """The ``ec_transfer_params`` that tell a consumer which items an encoder is still
    encoding: one entry per marked item, keyed by its ``uuid``, with the indices of its
    occurrences among the request's multimodal items (the consumer finds the item by
    identifier, else by index: with processor kwargs its identifier is a hash of the
    ``uuid``). An entry promises nothing a consumer trusts: it derives the key itself
    and waits at most ``promised_wait_s``. ``namespace``, where the encoders publish (their
    role check said so), goes with each mark: a consumer that reads elsewhere refuses the
    mark at once instead of waiting."""
    params: dict[str, Any] = {}
    for n in sorted(marked):
        item = items[n]
        identifier = item.part.get("uuid")
        if isinstance(identifier, str):
            params[identifier] = {PENDING_MARK: True, "item_indices": list(item.indices)}
            if namespace:
                params[identifier][NAMESPACE_FIELD] = namespace
    return params
