"""The placeholder metadata stored with a blob (S3 object metadata): only a modality and
numbers go in, and only those come out, whatever an object in the bucket holds."""

from __future__ import annotations

import json

import pytest

from ec_s3.blob.format import PLACEHOLDER_METADATA_KEY
from ec_s3.blob.placeholder import placeholder_json, read_placeholder

GRID = {"image_grid_thw": [1, 70, 70]}


def test_round_trip() -> None:
    text = placeholder_json({"modality": "image", "metadata": GRID, "item_indices": [0], "key": "k"})
    assert text == '{"metadata":{"image_grid_thw":[1,70,70]},"modality":"image"}'
    assert read_placeholder({PLACEHOLDER_METADATA_KEY: text}) == {"modality": "image", "metadata": GRID}


@pytest.mark.parametrize("entry", [
    {"modality": "image", "metadata": {}},  # LLaVA: nothing to size a placeholder with
    {"modality": "image"},
    {"modality": "hologram", "metadata": GRID},
    {"modality": "image", "metadata": {"image_grid_thw": "1,70,70"}},
    {"modality": "image", "metadata": {"image_grid_thw": [True, 70, 70]}},
    {"modality": "image", "metadata": {"image_grid_thw": list(range(400))}},  # over the size bound
])
def test_what_is_not_stored(entry: dict) -> None:
    assert placeholder_json(entry) is None


@pytest.mark.parametrize("text", [
    "not json", "[]", json.dumps({"modality": "image", "metadata": {"x": {"nested": 1}}}),
    json.dumps({"modality": "image", "metadata": GRID, "pad": "x" * 2000}),
])
def test_what_is_not_read(text: str) -> None:
    assert read_placeholder({PLACEHOLDER_METADATA_KEY: text}) is None
    assert read_placeholder({}) is None
