"""Metadata-only parts: prefill/decode never touches an image whose encoder output is in
the bucket and whose placeholder metadata the proxy knows. Pure functions, no I/O.

Owns building metadata-only parts (only where :data:`EXACT_METADATA` says the metadata is
exact, and only when every item of that modality in the request can go so), rewriting a
body with them, and the resend body with the media (:func:`resend_body`). Does not own
which items are known (:mod:`.skips`), naming (:mod:`.naming`) or sending (:mod:`.dispatch`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ec_s3.blob.placeholder import has_placeholder
from ec_s3.proxy.media import MediaItem, parts_of, replace_media_parts
from ec_s3.proxy.naming import CONTENT_PREFIX

__all__ = ["EXACT_METADATA", "is_exact", "metadata_only_body", "metadata_only_part", "resend_body", "resend_uuid"]

# The embeddings part type of each modality vLLM's chat API parses.
_EMBED_PART_OF = {"image": "image_embeds", "video": "video_embeds", "audio": "audio_embeds"}
# The modality of a raw media part, by the field holding its media (media.media_key).
_RAW_MODALITY = {"image_url": "image", "image_pil": "image", "audio_url": "audio", "input_audio": "audio",
                 "video_url": "video"}
# Per modality, the placeholder metadata a model's position code reads: a metadata-only
# part is exact only when its metadata carries every one of these keys (module docstring).
# Qwen-VL images: M-RoPE positions come from image_grid_thw alone. Qwen2.5-VL video also
# scales time by second_per_grid_ts, which vLLM does not publish (not an embedding field),
# so prefill/decode would take 1.0: video keeps its media. Audio: no model proven exact.
EXACT_METADATA: dict[str, frozenset[str]] = {
    "image": frozenset({"image_grid_thw"}),
    "video": frozenset({"video_grid_thw", "second_per_grid_ts"}),
}
# What a resend's fresh uuid ends with before its random tail (:func:`resend_uuid`).
RESEND_MARK = "-resend-"


def is_exact(entry: Any) -> bool:
    """Whether an entry's placeholder metadata lets prefill/decode compute exactly what the
    media would have given (:data:`EXACT_METADATA`); an entry must first pass
    :func:`~ec_s3.blob.placeholder.has_placeholder`."""
    needed = EXACT_METADATA.get(entry["modality"])
    return needed is not None and needed <= entry["metadata"].keys()


def metadata_only_part(
    part: Mapping[str, Any], entry: Any, identifier: str | None = None
) -> dict[str, Any] | None:
    """The metadata-only part that replaces media ``part``, from an encoder's entry for
    it; None when it cannot (no metadata, an unknown modality, metadata that is not
    exact, no uuid that gives the encoder's identifier). ``identifier`` (the entry's key)
    serves as the uuid of a part without the proxy's, when the request has no processor
    kwargs (the caller knows)."""
    uuid = part.get("uuid")
    if not isinstance(uuid, str) or not uuid.startswith(CONTENT_PREFIX):
        if uuid is not None or not identifier:
            return None  # a client's (namespaced) uuid: the encoder's identifier is a hash of it
        uuid = identifier
    if not has_placeholder(entry) or not is_exact(entry):  # a modality, metadata of numbers, all it needs
        return None
    kind = _EMBED_PART_OF[entry["modality"]]
    return {"type": kind, kind: dict(entry["metadata"]), "uuid": uuid}


def _entry_of(item: MediaItem, params: Mapping[str, Any]) -> tuple[str | None, Any]:
    """(identifier, entry) of ``params`` for ``item``: the one at the item's indices."""
    for identifier, entry in params.items():
        if isinstance(entry, Mapping) and entry.get("item_indices") == item.indices:
            return identifier, entry
    return None, None


def _raw_modalities(body: dict[str, Any], swapped: Sequence[Mapping[str, Any]]) -> set[str]:
    """The modalities of the media parts of ``body`` (null media included: vLLM parses
    those as raw items too) that are not among ``swapped``."""
    out: set[str] = set()
    for _, part, key in parts_of(body):
        if key is not None and not any(part == old for old in swapped):
            out.add(_RAW_MODALITY.get(key, key))
    return out


def metadata_only_body(
    body: dict[str, Any], items: Sequence[MediaItem], params: Mapping[str, Any]
) -> tuple[dict[str, Any], list[MediaItem]]:
    """``body`` with each of ``items`` whose entry in ``params`` gives its exact metadata
    sent metadata-only, and those items; the input is not modified (untouched messages
    are shared). A modality goes metadata-only only when every media part of it in the
    body does: vLLM refuses a request mixing raw and embeddings inputs of one modality
    ("Mixing raw image and embedding inputs is not allowed"), so when one item of a
    modality keeps its media (pending, unpublished, inexact), all of that modality do."""
    swaps: list[tuple[MediaItem, str, dict[str, Any]]] = []
    # vLLM takes a uuid as the identifier only without these (else it hashes it with them).
    verbatim = not body.get("mm_processor_kwargs") and not body.get("media_io_kwargs")
    for item in items:
        identifier, entry = _entry_of(item, params)
        new = metadata_only_part(item.part, entry, identifier if verbatim else None)
        if new is not None:
            swaps.append((item, entry["modality"], new))
    mixed = _raw_modalities(body, [item.part for item, _, _ in swaps])
    swaps = [s for s in swaps if s[1] not in mixed]
    return replace_media_parts(body, [(item.part, new) for item, _, new in swaps]), [item for item, _, _ in swaps]


def resend_uuid(name: str) -> str:
    """A fresh uuid for an item resent with its media (:func:`resend_body`): derived from
    its name, new to every cache (a random tail: vLLM's processor caches remember each
    uuid they saw, the metadata-only one included)."""
    base = name.split(RESEND_MARK, 1)[0]
    return f"{base}{RESEND_MARK}{secrets.token_hex(8)}"


def resend_body(
    body: dict[str, Any], items: Sequence[MediaItem], params: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``body``, ``params``) for the resend of a request whose metadata-only ``items``
    prefill/decode could not get: each of those parts keeps its media under a fresh uuid
    (:func:`resend_uuid`), and their entries leave ``params``, so that vLLM treats them
    as new items (its front-end processor cache would otherwise hand the engine the
    metadata-only item again under the old uuid) and prefill/decode encodes them itself."""
    swaps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    dropped: set[str] = set()
    for item in items:
        identifier, _ = _entry_of(item, params)
        if identifier is not None:
            dropped.add(identifier)
        name = item.part.get("uuid")
        base = name if isinstance(name, str) else identifier or "ecs3-item"
        swaps.append((item.part, {**item.part, "uuid": resend_uuid(base)}))
    return replace_media_parts(body, swaps), {k: v for k, v in params.items() if k not in dropped}
