"""Request and response bodies of the S3 store, without copies.

Owns :class:`BufferChain` (bytes held in several buffers, sent as one body), the CRC32 the
store stores beside a blob and the checksums an upload's header carries (CRC32, CRC32C,
SHA-256).
Does not own sending, retrying or where a downloaded body is written (the caller's
allocator decides; :mod:`ec_s3.store.client` does the I/O).
"""

from __future__ import annotations

import asyncio
import hashlib
import zlib
from collections.abc import Sequence

__all__ = ["CHECKSUM_HEADERS", "Body", "BufferChain", "crc32_of", "crc32c_of", "sha256_of"]

#: S3's checksum fields (as the client names them) and the headers that carry them on the wire.
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


async def crc32c_of(body: BufferChain) -> int:
    """CRC32C of the body (x-amz-checksum-crc32c) by awscrt, which the config requires
    for this algorithm (botocore's own CRC32C is awscrt's); large bodies off the loop."""
    from awscrt.checksums import crc32c  # only with checksum_algorithm: CRC32C

    def crc() -> int:
        value = 0
        for view in body.views:
            value = crc32c(view, value)
        return value

    return crc() if len(body) < (1 << 20) else await asyncio.to_thread(crc)
