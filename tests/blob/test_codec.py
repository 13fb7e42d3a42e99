"""Blob codec: stock-safetensors compatibility, zero-copy decode, and a decoder that
turns every malformed or unexpected blob into a typed BlobError (never a crash, never
a wrong tensor)."""

from __future__ import annotations

import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ec_s3.blob.codec import (
    MAX_HEADER_BYTES,
    BlobError,
    BlobExpectation,
    BlobLayout,
    BlobMeta,
    decode_blob,
    encode_blob,
)

IDENTIFIER = "mm-hash-0"
NS = "tiny-llava-0123456789abcdef"


def _blob(rows: int = 16, width: int = 128, dtype: torch.dtype = torch.bfloat16, identifier: str = IDENTIFIER) -> tuple[torch.Tensor, bytearray]:
    x = torch.randn(rows, width).to(dtype)
    return x, encode_blob(x, BlobMeta(identifier, dtype, (rows, width), NS, "producer-0"))


def _expect(**kw: object) -> BlobExpectation:
    args = dict(identifier=IDENTIFIER, namespace=NS, dtype=torch.bfloat16, rows=16, width=128)
    args.update(kw)
    return BlobExpectation(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_and_stock_safetensors_reads_it(dtype: torch.dtype) -> None:
    x, blob = _blob(dtype=dtype)
    stock = safetensors.torch.load(bytes(blob))
    assert list(stock) == ["ec_cache"] and torch.equal(stock["ec_cache"], x)
    decoded = decode_blob(blob, _expect(dtype=dtype))
    assert torch.equal(decoded.tensor, x)
    assert decoded.metadata["identifier"] == IDENTIFIER and decoded.metadata["producer"] == "producer-0"
    assert decoded.data_offset % 8 == 0


def test_decode_is_a_view_of_the_buffer() -> None:
    _, blob = _blob()
    decoded = decode_blob(blob, _expect())
    blob[decoded.data_offset] ^= 0xFF  # mutate the buffer: the tensor sees it
    assert decoded.tensor.reshape(-1).view(torch.uint8)[0].item() == blob[decoded.data_offset]


def test_layout_size_is_known_before_the_tensor() -> None:
    meta = BlobMeta(IDENTIFIER, torch.bfloat16, (1369, 3584), NS, "p")
    layout = BlobLayout.plan(meta)
    assert layout.total_nbytes == len(encode_blob(torch.zeros(1369, 3584, dtype=torch.bfloat16), meta))


def test_matches_stock_save_for_non_contiguous_input() -> None:
    x = torch.randn(128, 16).t()  # non-contiguous
    blob = encode_blob(x, BlobMeta(IDENTIFIER, torch.float32, (16, 128), NS))
    assert torch.equal(safetensors.torch.load(bytes(blob))["ec_cache"], x)


@pytest.mark.parametrize(
    ("expect", "reason"),
    [
        (dict(identifier="other"), "identifier"),
        (dict(namespace="other-ns"), "namespace"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(rows=17), "shape"),
        (dict(width=64), "shape"),
        (dict(max_bytes=1024), "too_large"),
    ],
)
def test_expectation_mismatch_is_rejected(expect: dict[str, object], reason: str) -> None:
    _, blob = _blob()
    with pytest.raises(BlobError) as err:
        decode_blob(blob, _expect(**expect))
    assert err.value.reason == reason


def _with_header(header: object, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "truncated"),
        (b"\x01\x00", "truncated"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "header_size"),
        (struct.pack("<Q", 2**63) + b"{}", "header_size"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "header_json"),
        (_with_header([1, 2]), "header_keys"),
        (_with_header({"ec_cache": {}, "__metadata__": {}, "extra": 1}), "header_keys"),
        (_with_header({"ec_cache": {"dtype": "BF16"}, "__metadata__": {}}), "header_tensor"),
        (_with_header({"ec_cache": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}, "__metadata__": {}}), "dtype"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}, "__metadata__": {}}), "shape"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}, "__metadata__": {}}), "shape"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [2], "data_offsets": [0, 1]}, "__metadata__": {}}, b"xx"), "data_offsets"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"a": 1}}, b"xx"), "header_metadata"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {}}, b"x"), "truncated"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {}}, b"xxx"), "trailing_bytes"),
        (_with_header({"ec_cache": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "__metadata__": {"format": "v0"}}, b"xx"), "format"),
    ],
)
def test_malformed_blobs_give_typed_errors(blob: bytes, reason: str) -> None:
    with pytest.raises(BlobError) as err:
        decode_blob(bytearray(blob), _expect())
    assert err.value.reason == reason


def test_truncation_at_every_length_is_rejected() -> None:
    _, blob = _blob(rows=2, width=8)
    for n in range(len(blob)):
        with pytest.raises(BlobError):
            decode_blob(bytearray(blob[:n]), _expect(rows=2, width=8))


_GOOD_X, _GOOD = _blob(rows=4, width=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_blobs_never_crash_or_lie(data: st.DataObject) -> None:
    """Random corruption (bit flips, truncation, extension, header splices): the decoder
    either raises BlobError or returns exactly the original tensor."""
    blob = bytearray(_GOOD)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice", "random"]))
    if kind == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "splice":
        pos = data.draw(st.integers(0, 200))
        blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
    else:
        blob = bytearray(data.draw(st.binary(max_size=512)))
    try:
        decoded = decode_blob(blob, _expect(rows=4, width=8))
    except BlobError:
        return
    # Flips inside the data region cannot be detected structurally (that is what the
    # optional S3 checksum is for); anything else that decodes must be the original.
    if kind != "flip":
        assert torch.equal(decoded.tensor, _GOOD_X)
    assert decoded.tensor.shape == (4, 8) and decoded.tensor.dtype == torch.bfloat16


@settings(max_examples=200, deadline=None)
@given(header=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
), tail=st.binary(max_size=64))
def test_fuzzed_headers_give_typed_errors(header: object, tail: bytes) -> None:
    with pytest.raises(BlobError):
        decode_blob(bytearray(_with_header(header, tail)), _expect(rows=4, width=8))
