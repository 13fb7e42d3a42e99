"""What the proxy reads and rewrites in a chat request body; pure functions, no I/O.

Owns finding the media items of ``messages`` (numbered the way the consumer numbers its
``mm_features``), the single-item body an encoder is sent, merging the encoders'
``ec_transfer_params`` and nulling published media (``forward_media=False``). It does not
own sending anything, choosing upstreams or error answers (:mod:`ec_s3.proxy.chat`),
and it never interprets identifiers: the consumer matches the merged params to its own
items.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "EMBED_PART_TYPES", "ENCODER_CARRIED_FIELDS", "MEDIA_PART_KEYS", "BodyError", "MediaItem", "TooDeeplyNested",
    "TooManyItems", "dump_body", "encoder_body", "encoder_payload", "find_media_items", "media_key", "merge_params", "parse_body",
    "parts_of", "replace_media_parts", "splice_params", "strip_media", "strip_published_media",
]

# Content-part types whose media an encoder turns into an encoder output. Embeddings
# (image_embeds, ...) are not encoded by anyone, so they are left alone.
MEDIA_PART_KEYS: dict[str, str] = {
    "image_url": "image_url",
    "input_image": "image_url",  # Responses-API style part
    "image_pil": "image_pil",
    "audio_url": "audio_url",
    "input_audio": "input_audio",
    "video_url": "video_url",
}
# Every content part that becomes one of vLLM's multimodal items (mm_features), in
# message order; used to number items the way the consumer's request does.
EMBED_PART_TYPES = frozenset({"image_embeds", "audio_embeds", "video_embeds"})
# Request fields that change an item's identifier (processor kwargs, decoded media) or
# its blob key (cache_salt): the encoder must see them to publish what the consumer
# will look for.
ENCODER_CARRIED_FIELDS = ("model", "cache_salt", "mm_processor_kwargs", "media_io_kwargs")


class BodyError(ValueError):
    """A request body the proxy refuses to handle (the client's fault: a 4xx)."""


class TooDeeplyNested(BodyError):
    """JSON nested deeper than Python's parser or serializer can recurse."""

    def __init__(self) -> None:
        super().__init__("request JSON is nested too deeply")


class TooManyItems(BodyError):
    """More media parts than ``max_items_per_request``: each would cost an encoder request."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"request has {count} media items; this server accepts at most {limit} per request")
        self.count = count
        self.limit = limit


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The request as a JSON object, or None when it is not one (not JSON, not an
    object: the PD answers those with its own error). Raises :class:`TooDeeplyNested`."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise TooDeeplyNested() from None
    except ValueError:  # not JSON, not UTF-8, an integer beyond Python's digit limit
        return None
    return body if isinstance(body, dict) else None


def dump_body(body: dict[str, Any]) -> bytes:
    """Compact JSON bytes of a parsed request (or a part of one); raises
    :class:`TooDeeplyNested` where the parser's depth was just within reach."""
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except RecursionError:
        raise TooDeeplyNested() from None


@dataclasses.dataclass
class MediaItem:
    """One distinct media part of a request and where it occurs among its mm items.

    ``part_json`` is the part serialised once (compact, the client's key order): the key that
    finds identical parts, and the bytes of the part in its encoder request. A media
    part is most of a request (a data URL of an image is megabytes), and each JSON
    serialisation of it costs ~2 ms per MB here: it is serialised once, not per use.
    """

    part: dict[str, Any]
    indices: list[int]
    part_json: str = ""


def find_media_items(body: dict[str, Any], limit: int | None = None) -> list[MediaItem]:
    """The distinct media parts of ``messages`` (identical parts once, with every index).

    Indices number all multimodal parts (embeddings included) in message order, which
    is how the consumer numbers its ``mm_features``; they replace the encoder's
    ``item_indices`` (always 0: it saw one item). Parts whose media is null (a ``uuid``
    reference to the PD's processor cache) are not sent to encoders: nothing to encode.

    More than ``limit`` parts to encode (repeats included: the consumer sees each one)
    raises :class:`TooManyItems`; past the limit parts are only counted, so a hostile
    list of thousands costs a scan, not thousands of copies.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    by_key: dict[str, MediaItem] = {}
    index = 0
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            media_key = _media_key(part)
            if media_key is None:
                part_type = part.get("type")  # any JSON value: a list is unhashable
                if isinstance(part_type, str) and part_type in EMBED_PART_TYPES:
                    index += 1
                continue
            if part.get(media_key) not in (None, "", {}):
                count += 1
                if limit is None or count <= limit:
                    item = by_key.get(key := _dedupe_key(part))
                    if item is None:
                        by_key[key] = MediaItem(part, [index], key)
                    else:
                        item.indices.append(index)
            index += 1
    if limit is not None and count > limit:
        raise TooManyItems(count, limit)
    return list(by_key.values())


def parts_of(body: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any], str | None]]:
    """Every dict content part of ``messages`` in order: (message, part, its media field
    as :func:`media_key` finds it, or None)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    yield message, part, _media_key(part)


def _dedupe_key(part: dict[str, Any]) -> str:
    """The part's compact JSON in the client's key order: it is also the part's text in
    its encoder request (:func:`encoder_payload`), so it is computed once. Parts equal
    up to key order are then sent twice; harmless (same identifier: merged params)."""
    try:
        return json.dumps(part, separators=(",", ":"))
    except RecursionError:
        raise TooDeeplyNested() from None


def _media_key(part: dict[str, Any]) -> str | None:
    """The field holding a part's media, as vLLM's parser finds it (``type``, or for
    untyped / uuid-carrying parts the first media field present), else None."""
    part_type = part.get("type")
    if isinstance(part_type, str) and part_type in MEDIA_PART_KEYS and part.get("uuid") is None:
        return MEDIA_PART_KEYS[part_type]
    if part_type is None or part.get("uuid") is not None:
        for key in ("image_url", "image_pil", "audio_url", "input_audio", "video_url"):
            if key in part:
                return key
    return None


media_key = _media_key


def encoder_body(body: dict[str, Any], item: MediaItem) -> dict[str, Any]:
    """The request an encoder is sent for ``item``: the item alone, with the fields that
    change its identifier or key, one token, no stream (sampling does not travel)."""
    carried = {k: body[k] for k in ENCODER_CARRIED_FIELDS if k in body}
    return {
        **carried,
        "messages": [{"role": "user", "content": [item.part]}],
        "max_tokens": 1,
        "stream": False,
    }


def encoder_payload(body: dict[str, Any], item: MediaItem) -> bytes:
    """:func:`encoder_body` serialised, reusing the part's serialisation
    (:attr:`MediaItem.part_json`) instead of encoding the media again."""
    if not item.part_json:
        return dump_body(encoder_body(body, item))
    rest = {k: body[k] for k in ENCODER_CARRIED_FIELDS if k in body}
    rest.update(max_tokens=1, stream=False)
    head = dump_body(rest)  # '{...}': small, the media is not in it
    # One join: each concatenation of a megabyte-sized part would copy it again.
    return b"".join((head[:-1], b',"messages":[{"role":"user","content":[', item.part_json.encode(), b"]}]}"))


_JSON_WS = frozenset(b" \t\r\n")


def splice_params(raw: bytes, body: dict[str, Any], params: dict[str, Any]) -> bytes | None:
    """``raw`` (the client's body, parsed as ``body``) with ``"ec_transfer_params":
    params`` appended as its last member, without serialising the request again (the
    media in it are most of its bytes). None when the bytes cannot be spliced safely:
    the body already has the field (it must be replaced, not duplicated), or ``raw``
    is not a UTF-8 object text (a BOM, UTF-16/32: JSON parsers accept those)."""
    if "ec_transfer_params" in body:
        return None
    start, end = 0, len(raw)
    while start < end and raw[start] in _JSON_WS:
        start += 1
    while end > start and raw[end - 1] in _JSON_WS:
        end -= 1
    if raw[start:start + 1] != b"{" or raw[end - 1:end] != b"}":
        return None
    # One copy of the client's bytes (a memoryview slice copies nothing).
    return b"".join((memoryview(raw)[start:end - 1], b"," if body else b"", b'"ec_transfer_params":',
                     dump_body(params), b"}"))


def merge_params(results: Sequence[tuple[MediaItem, dict[str, Any] | None]]) -> dict[str, Any]:
    """Union of the encoders' ``ec_transfer_params`` (keyed by identifier); an identifier
    answered twice keeps the first entry with the union of item indices."""
    merged: dict[str, Any] = {}
    for item, params in results:
        for identifier, entry in (params or {}).items():
            if isinstance(entry, dict) and "item_indices" in entry:
                entry = {**entry, "item_indices": list(item.indices)}
            if identifier not in merged:
                merged[identifier] = entry
            elif isinstance(merged[identifier], dict) and isinstance(entry, dict) and "item_indices" in entry:
                seen = merged[identifier].setdefault("item_indices", [])
                seen.extend(i for i in entry["item_indices"] if i not in seen)
    return merged


def strip_published_media(
    body: dict[str, Any], results: Sequence[tuple[MediaItem, dict[str, Any] | None]]
) -> dict[str, Any]:
    """``forward_media=False``: null the media of parts that an encoder published and that
    carry a ``uuid`` (vLLM's form for a part without data); every other part is kept."""
    return strip_media(body, [item.part for item, params in results if params])


def strip_media(body: dict[str, Any], parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``body`` with the media of the parts equal to one of ``parts`` and carrying a
    ``uuid`` nulled (vLLM's form for a part without data); every other part is kept."""
    published = [part for part in parts if part.get("uuid") is not None]
    return replace_media_parts(body, [(part, {**part, _media_key(part): None}) for part in published])


def replace_media_parts(
    body: dict[str, Any], swaps: Sequence[tuple[dict[str, Any], dict[str, Any]]]
) -> dict[str, Any]:
    """``body`` with every media part equal to the first of a pair of ``swaps`` replaced
    by its second; the input is not modified and untouched messages are shared."""
    if not swaps or not isinstance(body.get("messages"), list):
        return body
    messages = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        new_content, changed = [], False
        for part in content:
            if isinstance(part, dict) and _media_key(part) is not None:
                # Identical parts were merged into one item: match parts by value.
                for old, new in swaps:
                    if part == old:
                        part, changed = new, True
                        break
            new_content.append(part)
        messages.append({**message, "content": new_content} if changed else message)
    return {**body, "messages": messages}
