"""One attempt of a store request: the blob requests signed here, the rest through aiobotocore.

Owns :class:`Transport` (HEAD, single PUT, UploadPart and ranged GET over :mod:`.wire`, the
aiobotocore client beside it for the other S3 calls), :func:`open_transport`, the answers'
shape (:class:`ObjectInfo`, :class:`~.wire.GetAnswer`) and each upload's checksum. Does not own
retries, the breaker, the concurrency bound or ranges (:mod:`.client`, :mod:`.download`), the
client and its credentials (:mod:`.connection`), sending (:mod:`.wire`) or mapping errors
(:mod:`.errors`): a failure is raised as it is.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from ec_s3.store.body import CHECKSUM_HEADERS, BufferChain, crc32_of, crc32c_of, sha256_of
from ec_s3.store.connection import open_client, resolve_endpoint
from ec_s3.store.http1 import parse_http_date
from ec_s3.store.settings import StoreConfig
from ec_s3.store.wire import DirectWire, GetAnswer

__all__ = ["ObjectInfo", "Transport", "open_transport"]


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""
    last_modified: float = 0.0  # epoch seconds
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)


class Transport:
    """HEAD, ranged GET, PUT and UploadPart through :class:`~.wire.DirectWire`;
    ``client`` (aiobotocore) for listing, deleting, buckets and multipart bookkeeping."""

    def __init__(self, config: StoreConfig, client: Any, wire: DirectWire) -> None:
        self.config, self.client, self.bucket, self.wire = config, client, config.bucket, wire

    def checksum_args(self) -> dict[str, str]:
        """The client's argument naming the checksum (CreateMultipartUpload announces it)."""
        algo = self.config.checksum_algorithm
        return {} if algo == "none" else {"ChecksumAlgorithm": algo}

    async def head(self, key: str) -> ObjectInfo:
        headers = await self.wire.head(key)
        modified = parse_http_date(headers.get("Last-Modified"))
        prefix = "x-amz-meta-"
        return ObjectInfo(
            key=key, size=int(headers.get("Content-Length", "0") or 0), etag=headers.get("ETag", "").strip('"'),
            last_modified=modified if modified is not None else time.time(),
            metadata={k.lower()[len(prefix):]: v for k, v in headers.items() if k.lower().startswith(prefix)},
        )

    async def put(self, key: str, view: BufferChain, metadata: dict[str, str], crc: int | None) -> None:
        """A conditional single PUT (``If-None-Match: *``); a 412 is the caller's to read.
        ``crc`` is the body's CRC32 when the store computed it already."""
        headers = {"If-None-Match": "*", "Content-Type": "application/octet-stream",
                   **{f"x-amz-meta-{k}": v for k, v in metadata.items()}, **await self._checksum(view, crc)}
        await self.wire.put("PUT", key, view, headers)

    async def put_part(self, key: str, upload_id: str, number: int, chunk: BufferChain) -> dict[str, Any]:
        """One UploadPart; the part as CompleteMultipartUpload lists it."""
        sent = await self._checksum(chunk, None)
        query = f"partNumber={number}&uploadId={quote(upload_id, safe='-_.~')}"
        headers = await self.wire.put("UploadPart", key, chunk, dict(sent), query=query)
        done: dict[str, Any] = {"PartNumber": number, "ETag": headers.get("ETag", "")}
        for field, header in CHECKSUM_HEADERS.items():
            if value := headers.get(header) or sent.get(header):
                done[field] = value
        return done

    @contextlib.asynccontextmanager
    async def open_range(
        self, key: str, first: int, last: int | None, if_match: str | None = None
    ) -> AsyncIterator[GetAnswer]:
        """``Range: bytes=first-last`` of ``key`` (``last`` None: no Range, the whole
        object), its body unread; released on every way out."""
        async with self.wire.get(key, first, last, if_match) as answer:
            yield answer

    async def _checksum(self, body: BufferChain, crc: int | None) -> dict[str, str]:
        """The checksum header of ``body``; CRC32 reuses the CRC the store computed for
        its metadata."""
        algo = self.config.checksum_algorithm
        if algo == "CRC32":
            value = crc if crc is not None else await crc32_of(body)
            return {CHECKSUM_HEADERS["ChecksumCRC32"]: base64.b64encode(value.to_bytes(4, "big")).decode()}
        if algo == "CRC32C":
            value = await crc32c_of(body)
            return {CHECKSUM_HEADERS["ChecksumCRC32C"]: base64.b64encode(value.to_bytes(4, "big")).decode()}
        if algo == "SHA256":
            return {CHECKSUM_HEADERS["ChecksumSHA256"]: base64.b64encode(await sha256_of(body)).decode()}
        return {}


async def open_transport(config: StoreConfig, stack: contextlib.AsyncExitStack) -> Transport:
    """The store's transport, closed when ``stack`` closes. Fails (NoCredentialsError)
    when the AWS chain finds no credentials: at connect, not at the first request."""
    settings = resolve_endpoint(config)  # one region and CA for the client and the wire
    client, credentials = await open_client(config, stack, settings)
    # Its own pool beside the client's, which keeps the rare rest; closed first.
    wire = DirectWire(config, client, credentials, settings.trust)
    stack.push_async_callback(wire.close)
    return Transport(config, client, wire)
