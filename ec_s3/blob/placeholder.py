"""An item's placeholder metadata as stored with its blob: the S3 object metadata a
producer writes and a proxy's HEAD reads.

``{"modality": "image", "metadata": {"image_grid_thw": [1, 70, 70]}}`` as compact JSON.
Owns the encoding and its shape and size checks, both ways, so a bucket object can never
make a proxy send anything else. No I/O, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ec_s3.blob.format import MAX_PLACEHOLDER_METADATA_BYTES, PLACEHOLDER_METADATA_KEY

__all__ = ["has_placeholder", "placeholder_json", "read_placeholder"]

# The modalities whose embeddings part vLLM's chat API parses (image_embeds, ...).
_MODALITIES = frozenset({"image", "video", "audio"})


def _numbers(value: Any) -> bool:
    """A number, or a (nested) array of numbers: what vLLM accepts as metadata in JSON."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    return isinstance(value, list) and bool(value) and all(_numbers(v) for v in value)


def has_placeholder(entry: Any) -> bool:
    """Whether ``entry`` (vLLM's ``ec_transfer_params`` entry, or the stored form) names
    a modality of an embeddings part and holds placeholder metadata of numbers only."""
    if not isinstance(entry, Mapping) or entry.get("modality") not in _MODALITIES:
        return False
    metadata = entry.get("metadata")
    return (isinstance(metadata, Mapping) and bool(metadata)
            and all(isinstance(k, str) and _numbers(v) for k, v in metadata.items()))


def placeholder_json(entry: Mapping[str, Any]) -> str | None:
    """The stored form of a vLLM ``ec_transfer_params`` entry's placeholder metadata;
    None when it has none (LLaVA-like models), or it is not plain numbers, or too long."""
    if not has_placeholder(entry):
        return None
    text = json.dumps({"modality": entry["modality"], "metadata": dict(entry["metadata"])},
                      separators=(",", ":"), sort_keys=True)
    return text if len(text) <= MAX_PLACEHOLDER_METADATA_BYTES else None


def read_placeholder(object_metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """``{"modality", "metadata"}`` from an object's S3 metadata, or None when it holds
    none or something else."""
    text = object_metadata.get(PLACEHOLDER_METADATA_KEY)
    if not isinstance(text, str) or len(text) > MAX_PLACEHOLDER_METADATA_BYTES:
        return None
    try:
        entry = json.loads(text)
    except ValueError:
        return None
    return {"modality": entry["modality"], "metadata": entry["metadata"]} if has_placeholder(entry) else None
