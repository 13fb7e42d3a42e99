"""Keys: no client-chosen identifier can escape `<prefix>/<namespace>/` or collide."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ec_s3.blob.keys import KeySpace, model_namespace

HOSTILE = ["../x", "a/b", "", "x" * 4096, "nul\0byte", "ünïcødé/🙂", "/etc/passwd", "..", "\ud800", " ", "%2e%2e%2f"]


@pytest.fixture
def space() -> KeySpace:
    ns = model_namespace("/models/Qwen2.5-VL-7B", revision=None, dtype="bfloat16", encoder_width=3584)
    return KeySpace("ec-cache", ns)


@pytest.mark.parametrize("identifier", HOSTILE)
def test_hostile_identifiers_stay_in_namespace(space: KeySpace, identifier: str) -> None:
    key = space.key_for(identifier)
    assert key.startswith(space.root) and space.owns(key)
    tail = key[len(space.root):]
    assert "/" not in tail and ".." not in tail and len(key) < 200
    salted = space.key_for(identifier, cache_salt="tenant/../a")
    assert salted.startswith(space.root) and space.owns(salted) and salted != key


def test_distinct_identifiers_distinct_keys(space: KeySpace) -> None:
    keys = {space.key_for(i) for i in HOSTILE}
    assert len(keys) == len(HOSTILE)


@given(st.text())
def test_any_identifier_maps_into_namespace(identifier: str) -> None:
    space = KeySpace("p/q", "ns-1")
    key = space.key_for(identifier)
    assert space.owns(key) and key.count("/") == 3


@pytest.mark.parametrize(
    "key",
    ["ec-cache/other-ns/" + "a" * 64 + ".safetensors", "../" + "a" * 64, "ec-cache", None, 7,
     "ec-cache/NS/" + "A" * 64 + ".safetensors"],
)
def test_owns_rejects_foreign_keys(key: object) -> None:
    assert not KeySpace("ec-cache", "NS").owns(key)


def test_namespace_separates_models_and_is_readable() -> None:
    a = model_namespace("/a/llava", revision=None, dtype="bfloat16", encoder_width=4096)
    b = model_namespace("/b/llava", revision=None, dtype="bfloat16", encoder_width=4096)
    c = model_namespace("/a/llava", revision=None, dtype="float16", encoder_width=4096)
    assert len({a, b, c}) == 3 and a.startswith("llava-")
    assert model_namespace("../../x/../", revision="r", dtype="d", encoder_width=None).count("/") == 0
