"""The blob format: one encoder output as a standard safetensors file.

Readable by stock ``safetensors.torch.load`` (one tensor ``ec_cache`` plus string
metadata), but written and read here without needless copies: the header is planned from
(dtype, shape, metadata) alone so the upload body is one buffer, and decoding returns a
view of the downloaded buffer. Everything read is untrusted: any deviation raises
:class:`BlobError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import torch

from ec_s3.blob.format import FORMAT_TAG, FORMAT_VERSION, MAX_HEADER_BYTES, TENSOR_NAME, identifier_digest

__all__ = [
    "BlobError",
    "BlobExpectation",
    "BlobLayout",
    "BlobMeta",
    "DecodedBlob",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "TENSOR_NAME",
    "decode_blob",
    "encode_blob",
    "identifier_digest",
    "read_header",
]

# Identifiers longer than this are kept only as their digest in the header.
_MAX_STORED_IDENTIFIER = 1024
_MAX_NDIM = 4

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
for _name, _st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPE_TO_ST[getattr(torch, _name)] = _st
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


class BlobError(ValueError):
    """A blob is malformed or is not the blob the caller expects.

    ``reason`` is a short stable code (for metrics and tests); the message says more.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class BlobMeta:
    """What a blob says about itself, beyond its bytes."""

    identifier: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    namespace: str
    producer: str = ""

    @property
    def data_nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class BlobExpectation:
    """What a reader requires of a blob; ``None`` fields are not checked."""

    identifier: str
    namespace: str
    dtype: torch.dtype | None = None
    rows: int | None = None
    width: int | None = None
    max_bytes: int = 1 << 30


@dataclasses.dataclass(frozen=True)
class BlobLayout:
    """Byte layout of a blob: ``header`` (length prefix + padded JSON), then data."""

    header: bytes
    data_nbytes: int

    @property
    def data_offset(self) -> int:
        return len(self.header)

    @property
    def total_nbytes(self) -> int:
        return len(self.header) + self.data_nbytes

    @classmethod
    def plan(cls, meta: BlobMeta) -> BlobLayout:
        if meta.dtype not in _DTYPE_TO_ST:
            raise BlobError("dtype", f"cannot store dtype {meta.dtype}")
        if not 1 <= len(meta.shape) <= _MAX_NDIM or any(d < 0 for d in meta.shape):
            raise BlobError("shape", f"cannot store shape {meta.shape}")
        nbytes = meta.data_nbytes
        metadata = {
            "format": FORMAT_TAG,
            "identifier_sha256": identifier_digest(meta.identifier),
            "dtype": str(meta.dtype).removeprefix("torch."),
            "shape": ",".join(str(d) for d in meta.shape),
            "namespace": meta.namespace,
            "producer": meta.producer,
        }
        if _storable_identifier(meta.identifier):
            metadata["identifier"] = meta.identifier
        header = {
            TENSOR_NAME: {
                "dtype": _DTYPE_TO_ST[meta.dtype],
                "shape": list(meta.shape),
                "data_offsets": [0, nbytes],
            },
            "__metadata__": metadata,
        }
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
        # Pad with spaces so the data starts 8-byte aligned, as safetensors does.
        text += b" " * (-(8 + len(text)) % 8)
        if len(text) > MAX_HEADER_BYTES:
            raise BlobError("header_size", f"header of {len(text)} bytes exceeds {MAX_HEADER_BYTES}")
        return cls(header=struct.pack("<Q", len(text)) + text, data_nbytes=nbytes)

    def write(self, out: memoryview | bytearray, tensor: torch.Tensor) -> None:
        """Fill ``out`` (exactly ``total_nbytes`` long) with this blob: one copy."""
        if len(out) != self.total_nbytes:
            raise ValueError(f"buffer is {len(out)} bytes, blob needs {self.total_nbytes}")
        out[: self.data_offset] = self.header
        if self.data_nbytes:
            dst = torch.frombuffer(out, dtype=torch.uint8, count=self.data_nbytes, offset=self.data_offset)
            dst.copy_(tensor_bytes(tensor))


@dataclasses.dataclass(frozen=True)
class DecodedBlob:
    tensor: torch.Tensor
    metadata: Mapping[str, str]
    data_offset: int


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's storage (no copy when possible)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a host tensor")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def encode_blob(tensor: torch.Tensor, meta: BlobMeta) -> bytearray:
    """Encode a host tensor as a blob (one allocation, one copy)."""
    if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
        raise ValueError(f"tensor {tuple(tensor.shape)}/{tensor.dtype} does not match {meta}")
    layout = BlobLayout.plan(meta)
    out = bytearray(layout.total_nbytes)
    layout.write(out, tensor)
    return out


def _header_json(buf: bytes | bytearray | memoryview, max_bytes: int) -> tuple[Any, int]:
    """The header's JSON and its length, sizes checked before anything is parsed."""
    total = len(buf)
    if total > max_bytes:
        raise BlobError("too_large", f"blob of {total} bytes exceeds the {max_bytes}-byte limit")
    if total < 8:
        raise BlobError("truncated", f"blob of {total} bytes has no header length")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > MAX_HEADER_BYTES:
        raise BlobError("header_size", f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
    if 8 + hlen > total:
        raise BlobError("truncated", f"header length {hlen} runs past the {total}-byte blob")
    try:
        return json.loads(bytes(buf[8 : 8 + hlen]).decode("utf-8")), hlen
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BlobError("header_json", f"header is not valid JSON ({type(exc).__name__})") from None


def _tensor_of(entry: Any) -> tuple[torch.dtype, list[int]]:
    """The tensor entry's dtype and shape, each checked."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BlobError("header_tensor", "tensor entry must have exactly dtype, shape, data_offsets")
    dtype = _ST_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise BlobError("dtype", f"unsupported dtype {entry['dtype']!r}")
    shape = entry["shape"]
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= _MAX_NDIM
        or not all(type(d) is int and 0 <= d < (1 << 40) for d in shape)
    ):
        raise BlobError("shape", f"bad shape {shape!r}")
    return dtype, shape


def read_header(buf: bytes | bytearray | memoryview, *, max_bytes: int = 1 << 30) -> tuple[dict[str, Any], dict[str, str], int]:
    """Parse and structurally validate a blob header.

    Returns ``(tensor_entry, metadata, data_offset)``. Checks sizes before parsing
    anything and that the data region exactly fills the rest of the buffer.
    """
    header, hlen = _header_json(buf, max_bytes)
    # The version first: a later format may change everything below, and its blob must be
    # refused as "another version", not as a malformed header.
    _check_format_version(header)
    if not isinstance(header, dict) or set(header) != {TENSOR_NAME, "__metadata__"}:
        keys = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise BlobError("header_keys", f"expected exactly {TENSOR_NAME!r} and '__metadata__', got {keys}")
    entry, metadata = header[TENSOR_NAME], header["__metadata__"]
    dtype, shape = _tensor_of(entry)
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BlobError("header_metadata", "metadata must map strings to strings")
    nbytes, total = math.prod(shape) * _itemsize(dtype), len(buf)
    if entry["data_offsets"] != [0, nbytes]:
        raise BlobError("data_offsets", f"data_offsets {entry['data_offsets']!r} != [0, {nbytes}]")
    if 8 + hlen + nbytes != total:
        reason = "truncated" if 8 + hlen + nbytes > total else "trailing_bytes"
        raise BlobError(reason, f"data region of {nbytes} bytes does not fill the {total}-byte blob")
    if metadata.get("format") != FORMAT_TAG:
        raise BlobError("format", f"format {metadata.get('format')!r} is not {FORMAT_TAG!r}")
    return {"dtype": dtype, "shape": tuple(shape), "nbytes": nbytes}, metadata, 8 + hlen


def decode_blob(buf: bytearray | memoryview | bytes, expect: BlobExpectation) -> DecodedBlob:
    """Validate a blob against ``expect`` and return its tensor as a view of ``buf``.

    ``buf`` should be writable (a ``bytearray`` or writable memoryview) for a zero-copy
    view; read-only input is copied once.
    """
    entry, metadata, offset = read_header(buf, max_bytes=expect.max_bytes)
    if metadata.get("identifier_sha256") != identifier_digest(expect.identifier):
        raise BlobError("identifier", "blob belongs to another identifier")
    if metadata.get("namespace") != expect.namespace:
        raise BlobError("namespace", f"blob namespace {metadata.get('namespace')!r} != {expect.namespace!r}")
    dtype, shape = entry["dtype"], entry["shape"]
    if expect.dtype is not None and dtype != expect.dtype:
        raise BlobError("dtype", f"blob dtype {dtype} != expected {expect.dtype}")
    if expect.rows is not None or expect.width is not None:
        if len(shape) != 2:
            raise BlobError("shape", f"blob shape {shape} is not 2-D")
        if expect.rows is not None and shape[0] != expect.rows:
            raise BlobError("shape", f"blob has {shape[0]} rows, expected {expect.rows}")
        if expect.width is not None and shape[1] != expect.width:
            raise BlobError("shape", f"blob width {shape[1]} != expected {expect.width}")
    if isinstance(buf, bytes) or (isinstance(buf, memoryview) and buf.readonly):
        buf = bytearray(buf)
    if entry["nbytes"] == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=entry["nbytes"], offset=offset)
        tensor = flat.view(dtype).reshape(shape)
    return DecodedBlob(tensor=tensor, metadata=metadata, data_offset=offset)


def _check_format_version(header: Any) -> None:
    """Refuse a blob of another ec-s3 format version by name, saying what to do.

    Producers and consumers of different ec-s3 versions meet in one bucket only when they
    share a namespace (the derived namespace includes the format version; a configured
    ``namespace`` does not), so the advice names that too.
    """
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    tag = metadata.get("format") if isinstance(metadata, dict) else None
    if not isinstance(tag, str) or tag == FORMAT_TAG or not tag.startswith("ec-s3/"):
        return  # ours, or not an ec-s3 blob at all: the checks below say what is wrong
    version = tag.removeprefix("ec-s3/")
    newer = not version.isdigit() or int(version) > int(FORMAT_VERSION)
    action = (
        "it was written by a newer ec-s3: upgrade ec-s3 on this instance to the producers' version"
        if newer else
        "it was written by an older ec-s3: upgrade the producers, or let ec-s3 gc remove the old blobs"
    )
    raise BlobError(
        "format_version",
        f"blob format {tag[:64]!r} is not {FORMAT_TAG!r}, the one this ec-s3 reads; {action} "
        "(or give each version its own namespace); docs/deploy.md, Upgrades",
    )


def _storable_identifier(identifier: str) -> bool:
    try:
        encoded = identifier.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return len(encoded) <= _MAX_STORED_IDENTIFIER and "\0" not in identifier


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
