"""A client's embeddings tensors: refused, or checked against their grid. Pure, no I/O.

Owns that decision (:class:`ClientEmbedsRefused`, a 400, unless the proxy trusts its
clients; a trusted client's tensor only when its rows and width match what the fleet's
encoders publish for its ``*_grid_thw``), the tensor header reader (torch.save's zip or
``.npy``, never unpickled, no torch) and classifying parts as vLLM's parser does.
Does not own naming (:mod:`.naming`) or answering (:mod:`.chat`).
"""

from __future__ import annotations

import ast
import base64
import binascii
import io
import math
import pickle
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from ec_s3.log import logger
from ec_s3.proxy.media import BodyError

__all__ = ["ClientEmbedsRefused", "EmbedsRules", "TensorHeader", "check_client_embeds", "embeds_parts",
           "read_tensor_header"]

# vLLM's order for a part without type (or with a uuid): the first of these present.
_UNTYPED_ORDER = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds")
_EMBEDS = {"image_embeds": "image", "audio_embeds": "audio", "video_embeds": "video"}
_TYPED = {"image_embeds", "audio_embeds", "video_embeds", "text", "thinking", "input_text", "output_text",
          "input_image", "image_url", "prompt_embeds", "image_pil", "audio_url", "input_audio", "refusal",
          "video_url", "tool_reference"}
# torch storages a plain dense tensor is saved with -> (dtype, bytes per element, floating).
_STORAGES = {
    "FloatStorage": ("float32", 4, True), "HalfStorage": ("float16", 2, True),
    "BFloat16Storage": ("bfloat16", 2, True), "DoubleStorage": ("float64", 8, True),
    "LongStorage": ("int64", 8, False), "IntStorage": ("int32", 4, False), "ShortStorage": ("int16", 2, False),
    "CharStorage": ("int8", 1, False), "ByteStorage": ("uint8", 1, False), "BoolStorage": ("bool", 1, False),
}
_NPY = {"<f4": ("float32", 4, True), "<f2": ("float16", 2, True), "<f8": ("float64", 8, True)}
_MAX_PICKLE_BYTES = 64 * 1024  # a tensor's data.pkl is ~160 B
_MAX_GRID_PRODUCT = 1 << 31


class ClientEmbedsRefused(BodyError):
    """A client's embeddings tensor the proxy will not forward (the message says why)."""


class TensorHeader:
    """What a serialised tensor declares: dtype, shape, whether floating point."""

    __slots__ = ("dtype", "floating", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], floating: bool) -> None:
        self.dtype, self.shape, self.floating = dtype, shape, floating


class _Rule:
    __slots__ = ("grid_key", "keys", "merge", "width")

    def __init__(self, keys: frozenset[str], grid_key: str, merge: int, width: int) -> None:
        self.keys, self.grid_key, self.merge, self.width = keys, grid_key, merge, width

    def same(self, other: _Rule) -> bool:
        return (self.keys, self.grid_key, self.merge, self.width) == (other.keys, other.grid_key, other.merge,
                                                                      other.width)


class EmbedsRules:
    """Per modality, what the fleet's encoders publish: the metadata keys, the grid key,
    the merge size and the width. Learned from encoder answers; two that disagree (two
    models behind one proxy) leave the modality unverifiable."""

    def __init__(self) -> None:
        self._rules: dict[str, _Rule | None] = {}
        self._lock = threading.Lock()  # learned on the loop, read in parsing threads

    def learn(self, params: Mapping[str, Any] | None) -> None:
        for entry in (params or {}).values():
            rule = _rule_of(entry)
            if rule is None:
                continue
            modality = entry["modality"]
            with self._lock:
                if modality not in self._rules:
                    self._rules[modality] = rule
                    continue
                known = self._rules[modality]
                if known is not None and not known.same(rule):
                    self._rules[modality] = None
                    logger.warning("ec-s3 proxy: encoders publish two shapes of %s embeddings (two models?); "
                                   "clients' %s tensors are refused from now on", modality, modality)

    def rule(self, modality: str) -> _Rule | None:
        with self._lock:
            return self._rules.get(modality)


def _rule_of(entry: Any) -> _Rule | None:
    """The rule an encoder's entry shows: ``shape[0] * m² == prod(grid)``."""
    if not isinstance(entry, Mapping) or entry.get("modality") not in _EMBEDS.values():
        return None
    metadata, shape = entry.get("metadata"), entry.get("shape")
    if not isinstance(metadata, Mapping) or not isinstance(shape, list) or len(shape) != 2:
        return None
    if not all(type(d) is int and d > 0 for d in shape):
        return None
    grids = [k for k in metadata if isinstance(k, str) and k.endswith("_grid_thw")]
    if len(grids) != 1:
        return None
    grid = metadata[grids[0]]
    if not _grid_ok(grid):
        return None
    product = math.prod(grid)
    if product % shape[0]:
        return None
    merge = math.isqrt(product // shape[0])
    if merge * merge * shape[0] != product:
        return None
    return _Rule(frozenset(metadata), grids[0], merge, shape[1])


def _grid_ok(grid: Any) -> bool:
    return (isinstance(grid, list) and len(grid) == 3 and all(type(d) is int and d > 0 for d in grid)
            and math.prod(grid) <= _MAX_GRID_PRODUCT)


def embeds_parts(body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(part type, value) of every part vLLM parses as ``*_embeds``."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            part_type, uuid = part.get("type"), part.get("uuid")
            if isinstance(part_type, str) and part_type in _TYPED and uuid is None:
                if part_type in _EMBEDS:
                    yield part_type, part.get(part_type)
                continue
            if part_type is None or uuid is not None:
                for key in _UNTYPED_ORDER:
                    if key in part:
                        if key in _EMBEDS:
                            yield key, part.get(key)
                        break


def _carries_tensor(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and any(isinstance(v, str) for v in value.values()))


def check_client_embeds(body: Mapping[str, Any], *, trusted: bool, rules: EmbedsRules) -> int:
    """Raise :class:`ClientEmbedsRefused` for a tensor the proxy may not forward; the
    number of tensors checked and accepted."""
    accepted = 0
    for part_type, value in embeds_parts(body):
        if not _carries_tensor(value):
            continue  # a metadata-only part or a cache reference: :mod:`.naming` decides
        if not trusted:
            raise ClientEmbedsRefused(
                f"{part_type} parts carrying a tensor are not accepted by this server (an embedding that does "
                "not fit its grid would stop prefill/decode): send the media instead")
        _check_trusted(part_type, value, rules)
        accepted += 1
    return accepted


def _check_trusted(part_type: str, value: Any, rules: EmbedsRules) -> None:
    modality = _EMBEDS[part_type]
    rule = rules.rule(modality)
    if rule is None:
        raise ClientEmbedsRefused(
            f"this server cannot check a {part_type} tensor against its grid (no encoder has published {modality} "
            f"embeddings with a *_grid_thw here yet, or the model has none): send the media instead")
    if not isinstance(value, dict):
        raise ClientEmbedsRefused(f"a {part_type} tensor must come with its {rule.grid_key}: send "
                                  f'{{"{part_type}": <tensor>, "{rule.grid_key}": [t, h, w]}}')
    tensors = [k for k, v in value.items() if isinstance(v, str)]
    if tensors != [part_type] or set(value) - {part_type} != rule.keys:
        raise ClientEmbedsRefused(
            f"a {part_type} value must hold the tensor under {part_type!r} and exactly the metadata "
            f"{sorted(rule.keys)} as JSON arrays")
    grid = value[rule.grid_key]
    if not _grid_ok(grid) or grid[1] % rule.merge or grid[2] % rule.merge:
        raise ClientEmbedsRefused(f"{rule.grid_key} must be [t, h, w] of positive integers, h and w multiples "
                                  f"of {rule.merge}")
    try:
        header = read_tensor_header(value[part_type])
    except ValueError as exc:
        raise ClientEmbedsRefused(f"the {part_type} tensor cannot be read: {exc}") from None
    rows = math.prod(grid) // (rule.merge * rule.merge)
    if not header.floating or header.shape != (rows, rule.width):
        raise ClientEmbedsRefused(
            f"the {part_type} tensor is {header.dtype} {list(header.shape)}; its {rule.grid_key} {grid} needs a "
            f"floating-point tensor of shape [{rows}, {rule.width}]")


def read_tensor_header(data: str) -> TensorHeader:
    """dtype and shape of a base64 tensor as vLLM loads it (``.npy``, else torch.save's
    zip); ValueError for anything else, or one whose data does not match its header."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    if raw[:6] == b"\x93NUMPY":
        return _npy_header(raw)
    return _torch_header(raw)


def _npy_header(raw: bytes) -> TensorHeader:
    major = raw[6] if len(raw) > 9 else 0
    if major == 1:
        length, start = int.from_bytes(raw[8:10], "little"), 10
    elif major in (2, 3):
        length, start = int.from_bytes(raw[8:12], "little"), 12
    else:
        raise ValueError("not a .npy array")
    try:
        header = ast.literal_eval(raw[start:start + length].decode("latin1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError("bad .npy header") from None
    if not isinstance(header, dict) or header.get("descr") not in _NPY:
        raise ValueError("a .npy array must be little-endian float16, float32 or float64")
    shape = header.get("shape")
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("bad .npy shape")
    dtype, size, floating = _NPY[header["descr"]]
    if len(raw) - start - length != math.prod(shape) * size:
        raise ValueError("the .npy data does not match its shape")
    return TensorHeader(dtype, shape, floating)


class _Storage:
    __slots__ = ("key", "numel", "spec")

    def __init__(self, spec: tuple[str, int, bool], key: str, numel: int) -> None:
        self.spec, self.key, self.numel = spec, key, numel


class _StorageType:
    def __init__(self, name: str) -> None:
        self.spec = _STORAGES[name]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> tuple[_Storage, TensorHeader]:
    ints = (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(type(d) is int and d >= 0 for d in (*size, *stride)) and type(offset) is int and offset >= 0)
    if not isinstance(storage, _Storage) or not ints:
        raise ValueError("not a plain tensor")
    if all(size):
        extent = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
        if extent > storage.numel:
            raise ValueError("the tensor reaches past its storage")
    dtype, _, floating = storage.spec
    return storage, TensorHeader(dtype, size, floating)


class _HeaderUnpickler(pickle.Unpickler):
    """Reads torch.save's ``data.pkl`` of one dense tensor; builds nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> _Storage:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            return _Storage(pid[1].spec, pid[2], pid[4])
        raise pickle.UnpicklingError("not a tensor storage")


def _torch_header(raw: bytes) -> TensorHeader:
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        names = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
        if len(names) != 1 or names[0].file_size > _MAX_PICKLE_BYTES or names[0].compress_type != zipfile.ZIP_STORED:
            raise ValueError("not a torch.save file")
        prefix = names[0].filename[: -len("data.pkl")]
        result = _HeaderUnpickler(io.BytesIO(archive.read(names[0]))).load()
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], TensorHeader)):
            raise ValueError("not a single tensor")
        storage, header = result
        info = archive.getinfo(f"{prefix}data/{storage.key}")
        if info.file_size != storage.numel * storage.spec[1]:
            raise ValueError("the tensor's data does not match its storage")
        return header
    except ValueError:
        raise
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, TypeError, IndexError, AttributeError,
            MemoryError, RecursionError, OverflowError) as exc:
        raise ValueError(f"not a torch.save file of one dense tensor ({exc.__class__.__name__})") from None
