"""One attempt of a store request, on the data path chosen once when the store connects.

Owns the two transports (:class:`DirectTransport` over :mod:`.wire`, :class:`BotocoreTransport`
over the aiobotocore client; :func:`open_transport` builds one), the shape of their answers
(:class:`ObjectInfo`, a :class:`~.wire.GetAnswer` per ranged GET) and the checksum arguments
each path sends. Does not own retries, the breaker, the concurrency bound or a GET's ranges
(:mod:`.client`), building the client (:mod:`.connection`), sending direct requests
(:mod:`.wire`) or mapping errors (:mod:`.errors`): a failure is raised as it is.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from ec_s3.store.body import CHECKSUM_HEADERS, BufferChain, ChainReader, crc32_of, sha256_of
from ec_s3.store.connection import open_client, resolve_endpoint
from ec_s3.store.http1 import parse_http_date
from ec_s3.store.ranges import BotocoreAnswer
from ec_s3.store.settings import StoreConfig
from ec_s3.store.wire import DirectWire, GetAnswer

__all__ = ["BotocoreTransport", "DirectTransport", "ObjectInfo", "Transport", "open_transport"]

#: Checksums the direct path computes itself; any other goes through botocore.
_DIRECT_CHECKSUMS = ("none", "CRC32", "SHA256")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""
    last_modified: float = 0.0  # epoch seconds
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)


class BotocoreTransport:
    """Every request through the aiobotocore client."""

    def __init__(self, config: StoreConfig, client: Any) -> None:
        self.config, self.client, self.bucket = config, client, config.bucket

    def checksum_args(self) -> dict[str, str]:
        algo = self.config.checksum_algorithm
        return {} if algo == "none" else {"ChecksumAlgorithm": algo}

    async def head(self, key: str) -> ObjectInfo:
        resp = await self.client.head_object(Bucket=self.bucket, Key=key)
        modified = resp.get("LastModified")
        return ObjectInfo(key=key, size=int(resp.get("ContentLength", 0)), etag=str(resp.get("ETag", "")).strip('"'),
                          last_modified=modified.timestamp() if modified else time.time(),
                          metadata=dict(resp.get("Metadata") or {}))

    async def put(self, key: str, view: BufferChain, metadata: dict[str, str], crc: int | None) -> None:
        """A conditional single PUT (``If-None-Match: *``); a 412 is the caller's to read.
        ``crc`` is the body's CRC32 when the store computed it already."""
        await self.client.put_object(
            Bucket=self.bucket, Key=key, Body=ChainReader(view), ContentLength=len(view), IfNoneMatch="*",
            Metadata=metadata, ContentType="application/octet-stream", **self.checksum_args(),
        )

    async def put_part(self, key: str, upload_id: str, number: int, chunk: BufferChain) -> dict[str, Any]:
        """One UploadPart; the part as CompleteMultipartUpload lists it."""
        resp = await self.client.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
            Body=ChainReader(chunk), ContentLength=len(chunk), **self.checksum_args(),
        )
        return {"PartNumber": number, "ETag": resp["ETag"], **{f: resp[f] for f in CHECKSUM_HEADERS if resp.get(f)}}

    @contextlib.asynccontextmanager
    async def open_range(
        self, key: str, first: int, last: int | None, if_match: str | None = None
    ) -> AsyncIterator[GetAnswer]:
        """``Range: bytes=first-last`` of ``key`` (``last`` None: no Range, the whole
        object), its body unread; released on every way out (an unclosed body pins its
        pooled connection)."""
        condition = {"IfMatch": if_match} if if_match else {}
        if last is not None:
            condition["Range"] = f"bytes={first}-{last}"
        resp = await self.client.get_object(Bucket=self.bucket, Key=key, **condition)
        body = resp["Body"]
        try:
            yield BotocoreAnswer(resp, body, key)
        finally:
            body.close()  # a no-op on a body read to its end


class DirectTransport(BotocoreTransport):
    """HEAD, ranged GET and (with a checksum it computes) PUT and UploadPart through
    :class:`~.wire.DirectWire`; the rest through the client."""

    def __init__(self, config: StoreConfig, client: Any, wire: DirectWire) -> None:
        super().__init__(config, client)
        self.wire = wire
        self._direct_puts = config.checksum_algorithm in _DIRECT_CHECKSUMS

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
        if not self._direct_puts:
            return await super().put(key, view, metadata, crc)
        headers = {"If-None-Match": "*", "Content-Type": "application/octet-stream",
                   **{f"x-amz-meta-{k}": v for k, v in metadata.items()}, **await self._checksum(view, crc)}
        await self.wire.put("PUT", key, view, headers)

    async def put_part(self, key: str, upload_id: str, number: int, chunk: BufferChain) -> dict[str, Any]:
        if not self._direct_puts:
            return await super().put_part(key, upload_id, number, chunk)
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
        async with self.wire.get(key, first, last, if_match) as answer:
            yield answer

    async def _checksum(self, body: BufferChain, crc: int | None) -> dict[str, str]:
        """The checksum headers of ``body``; CRC32 reuses the CRC the store computed for
        its metadata."""
        algo = self.config.checksum_algorithm
        if algo == "CRC32":
            value = crc if crc is not None else await crc32_of(body)
            return {CHECKSUM_HEADERS["ChecksumCRC32"]: base64.b64encode(value.to_bytes(4, "big")).decode()}
        if algo == "SHA256":
            return {CHECKSUM_HEADERS["ChecksumSHA256"]: base64.b64encode(await sha256_of(body)).decode()}
        return {}


Transport = BotocoreTransport | DirectTransport


async def open_transport(config: StoreConfig, stack: contextlib.AsyncExitStack) -> Transport:
    """The transport ``config.data_path`` names, closed when ``stack`` closes."""
    settings = resolve_endpoint(config)  # one region and CA for both paths
    client = await open_client(config, stack, settings)
    if config.data_path != "direct":
        return BotocoreTransport(config, client)
    # Its own pool beside the client's, which keeps the rare rest; closed first.
    wire = DirectWire(config, client, settings.trust)
    stack.push_async_callback(wire.close)
    return DirectTransport(config, client, wire)
