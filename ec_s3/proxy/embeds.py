"""Metadata-only parts: prefill/decode never touches an image whose encoder output is in
the bucket and whose placeholder metadata the proxy knows. Pure functions, no I/O.

For models whose processor declares vLLM's ``embedding_fields`` (the Qwen-VL family), an
EC consumer accepts an item that carries only its placeholder metadata, e.g.
``{"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 70, 70]}, "uuid": U}``,
and takes the embedding from the connector: no image decode, no HF image processor (21 ms
and a 22 MiB ``pixel_values`` per 1024² photo), a 340 B part instead of a data URL.

The proxy knows that metadata from an encoder's ``ec_transfer_params`` entry (vLLM puts the
model's placeholder metadata fields there: ``metadata``, ``modality``); an entry with no
metadata (LLaVA-like models declare none) keeps the media. The part keeps the ``uuid``
the proxy gave it (its content identifier): the encoder derived its identifier from that
uuid and the request's processor kwargs, and prefill/decode derives the same from the same
uuid and kwargs (vLLM hashes a uuid with ``mm_processor_kwargs`` and ``media_io_kwargs``
on both sides alike). A part the proxy did not name (serial dispatch) gets the encoder's
identifier as its uuid, which vLLM then uses as is, but only in a request without those
kwargs (with them vLLM would hash it again); otherwise it keeps its media.

Parallel dispatch sends a pending item (its encoder has not answered yet) with its media:
its metadata is known only when the encoder answers, and the consumer must be able to
encode it itself if the encoder fails. Items the proxy already knows (an encoder answered
for them before) go metadata-only under either dispatch.

A consumer that cannot get the blob of a metadata-only item (deleted, corrupt) fails that
request alone; the proxy then sends it once more with the media (:mod:`.dispatch`).

Owns building metadata-only parts and rewriting a body with them. Does not own which
items are known (:mod:`.skips`), naming (:mod:`.naming`) or sending (:mod:`.dispatch`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ec_s3.blob.placeholder import has_placeholder
from ec_s3.proxy.media import MediaItem, replace_media_parts
from ec_s3.proxy.naming import CONTENT_PREFIX

__all__ = ["metadata_only_body", "metadata_only_part"]

# The embeddings part type of each modality vLLM's chat API parses.
_EMBED_PART_OF = {"image": "image_embeds", "video": "video_embeds", "audio": "audio_embeds"}


def metadata_only_part(
    part: Mapping[str, Any], entry: Any, identifier: str | None = None
) -> dict[str, Any] | None:
    """The metadata-only part that replaces media ``part``, from an encoder's entry for
    it; None when it cannot (no metadata, an unknown modality, no uuid that gives the
    encoder's identifier). ``identifier`` (the entry's key) serves as the uuid of a part
    without the proxy's, when the request has no processor kwargs (the caller knows)."""
    uuid = part.get("uuid")
    if not isinstance(uuid, str) or not uuid.startswith(CONTENT_PREFIX):
        if uuid is not None or not identifier:
            return None  # a client's (namespaced) uuid: the encoder's identifier is a hash of it
        uuid = identifier
    if not has_placeholder(entry):  # a modality, and metadata of numbers only
        return None
    kind = _EMBED_PART_OF[entry["modality"]]
    return {"type": kind, kind: dict(entry["metadata"]), "uuid": uuid}


def _entry_of(item: MediaItem, params: Mapping[str, Any]) -> tuple[str | None, Any]:
    """(identifier, entry) of ``params`` for ``item``: the one at the item's indices."""
    for identifier, entry in params.items():
        if isinstance(entry, Mapping) and entry.get("item_indices") == item.indices:
            return identifier, entry
    return None, None


def metadata_only_body(
    body: dict[str, Any], items: Sequence[MediaItem], params: Mapping[str, Any]
) -> tuple[dict[str, Any], int]:
    """``body`` with each of ``items`` whose entry in ``params`` gives its metadata sent
    metadata-only, and how many were; the input is not modified (untouched messages are
    shared)."""
    swaps: list[tuple[dict[str, Any], dict[str, Any]]] = []
    # vLLM takes a uuid as the identifier only without these (else it hashes it with them).
    verbatim = not body.get("mm_processor_kwargs") and not body.get("media_io_kwargs")
    for item in items:
        identifier, entry = _entry_of(item, params)
        new = metadata_only_part(item.part, entry, identifier if verbatim else None)
        if new is not None:
            swaps.append((item.part, new))
    return replace_media_parts(body, swaps), len(swaps)
