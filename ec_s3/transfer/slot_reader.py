"""Worker side of staging: map a slot and prove its blob is the one the scheduler meant.

Before a byte is used, on the mapped file itself: opened without following a symlink, a
regular file of the blob's size, whose header names the expected identifier, dtype, shape
and data offset; a path gone or replaced is reopened through the scheduler's handle.
Owns that check. Does not own slot lifetimes (:mod:`ec_s3.transfer.staging`) or copying
the tensor to a device (the connector's worker).
"""

from __future__ import annotations

import contextlib
import mmap

from ec_s3.blob.codec import BlobError, identifier_digest, read_header
from ec_s3.transfer.staging import map_handle, map_slot

__all__ = ["SlotMismatch", "map_verified_slot"]


class SlotMismatch(BlobError):
    """The staging file is not (or no longer) the blob the load spec describes."""


def map_verified_slot(
    path: str, *, identifier: str, nbytes: int, data_offset: int, dtype: str, shape: tuple[int, ...],
    handle: str = "", inode: tuple[int, int] = (0, 0),
) -> tuple[mmap.mmap, bool]:
    """Map the slot read-only (copy-on-write) after checking it is the expected blob;
    the mapping, and whether it came through ``handle`` because ``path`` did not lead
    to the slot's ``inode``.

    Raises ``OSError`` if neither can be opened (gone, a symlink, not a regular file,
    another inode) and :class:`SlotMismatch` (a ``ValueError``) if it is another blob.
    """
    try:
        mm, reopened = map_slot(path, inode=inode), False
    except OSError:
        if not handle:
            raise
        mm, reopened = map_handle(handle, inode), True
    try:
        _check(mm, identifier=identifier, nbytes=nbytes, data_offset=data_offset, dtype=dtype, shape=shape)
    except BaseException:
        with contextlib.suppress(BufferError):
            mm.close()
        raise
    return mm, reopened


def _check(
    mm: mmap.mmap, *, identifier: str, nbytes: int, data_offset: int, dtype: str, shape: tuple[int, ...],
) -> None:
    if len(mm) != nbytes:
        raise SlotMismatch("size", f"staging file is {len(mm)} bytes, expected {nbytes}")
    try:
        entry, metadata, offset = read_header(mm, max_bytes=max(nbytes, 1))
    except BlobError as exc:
        raise SlotMismatch("header", f"staging file has no valid blob header ({exc})") from None
    if metadata.get("identifier_sha256") != identifier_digest(identifier):
        raise SlotMismatch("identifier", "staging file holds another item's blob")
    found_dtype = str(entry["dtype"]).removeprefix("torch.")
    if offset != data_offset or found_dtype != dtype or tuple(entry["shape"]) != tuple(shape):
        raise SlotMismatch(
            "layout", f"staging file is {found_dtype}{list(entry['shape'])}@{offset}, "
            f"expected {dtype}{list(shape)}@{data_offset}",
        )
