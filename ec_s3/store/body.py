"""Request and response bodies of the S3 store, without copies.

Owns :class:`BufferChain` (bytes held in several buffers, sent as one body), the
seekable reader botocore gets for it, the CRC32 the store stores beside a blob and the
SHA-256 of a checksum header.
Does not own sending, retrying or where a downloaded body is written (the caller's
allocator decides; :mod:`ec_s3.store.client` does the I/O).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["CHECKSUM_HEADERS", "Body", "BufferChain", "ChainReader", "crc32_of", "sha256_of"]

#: botocore's checksum fields and the headers that carry them on the wire.
CHECKSUM_HEADERS = {
    "ChecksumCRC32": "x-amz-checksum-crc32",
    "ChecksumCRC32C": "x-amz-checksum-crc32c",
    "ChecksumSHA256": "x-amz-checksum-sha256",
}


class BufferChain:
    """Bytes held in several buffers, sent as one body without joining them.

    A producer's blob is a small header plus the encoder output's own memory; joining
    them would copy the whole tensor (and double the memory held while it uploads).
    """

    __slots__ = ("views", "nbytes")

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        self.views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        self.nbytes = sum(len(v) for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def slice(self, start: int, end: int) -> BufferChain:
        out, pos = [], 0
        for view in self.views:
            lo, hi = max(start - pos, 0), min(end - pos, len(view))
            if lo < hi:
                out.append(view[lo:hi])
            pos += len(view)
        return BufferChain(out)


Body = bytes | bytearray | memoryview | BufferChain


class ChainReader(io.RawIOBase):
    """A seekable file over a :class:`BufferChain`: what botocore needs as a body
    (it accepts bytes or file objects, not memoryviews), without copying."""

    def __init__(self, chain: BufferChain) -> None:
        super().__init__()
        self._views = chain.views
        self._len = chain.nbytes
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._len

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written, pos, base = 0, self._pos, 0
        for view in self._views:
            if written == len(out):
                break
            if pos < base + len(view):
                lo = pos - base
                n = min(len(view) - lo, len(out) - written)
                out[written : written + n] = view[lo : lo + n]
                written += n
                pos += n
            base += len(view)
        self._pos = pos
        return written

    def read(self, size: int = -1) -> bytes:
        n = self._len - self._pos if size is None or size < 0 else min(size, self._len - self._pos)
        buf = bytearray(n)
        return bytes(buf[: self.readinto(buf)])


async def crc32_of(body: memoryview | BufferChain) -> int:
    """zlib CRC32 (~4 GB/s); large buffers off the loop thread."""
    chain = body if isinstance(body, BufferChain) else BufferChain([body])

    def crc() -> int:
        value = 0
        for view in chain.views:
            value = zlib.crc32(view, value)
        return value

    return crc() if len(chain) < (1 << 20) else await asyncio.to_thread(crc)


async def sha256_of(body: BufferChain) -> bytes:
    """SHA-256 of the body (x-amz-checksum-sha256); large bodies off the loop thread."""
    def digest() -> bytes:
        h = hashlib.sha256()
        for view in body.views:
            h.update(view)
        return h.digest()

    return digest() if len(body) < (1 << 20) else await asyncio.to_thread(digest)
