"""A whole-blob PUT: one conditional PUT of an immutable blob, or a multipart upload of it.

Owns what the PUT of one blob carries (the ``max_blob_bytes`` bound, the CRC32 metadata, a
write token), the choice between a single PUT and a multipart upload, a 412 read as "already
there" and whether it met this write's own blob (an attempt whose answer was lost). Does not
own the request loop, its retries, the breaker or the concurrency bound
(:class:`ec_s3.store.client.S3Store`, reached through :class:`~.multipart.UploadingStore`),
nor the steps of a multipart upload (:mod:`.multipart`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from ec_s3.log import logger
from ec_s3.store.body import Body, BufferChain, crc32_of
from ec_s3.store.download import CRC_METADATA_KEY
from ec_s3.store.errors import PutOutcome, StoreError, StoreRequestError
from ec_s3.store.multipart import UploadingStore, put_multipart
from ec_s3.store.transport import Transport

__all__ = ["WRITE_TOKEN_METADATA_KEY", "put_blob"]

#: The object metadata that names the write which stored it (one random token per
#: put_async): after a 412, a HEAD tells this write's own blob, stored by an attempt
#: whose answer was lost, from another writer's.
WRITE_TOKEN_METADATA_KEY = "ec-s3-write"


async def put_blob(store: UploadingStore, key: str, body: Body, metadata: dict[str, str] | None) -> PutOutcome:
    """Store an immutable blob; a 412 from the conditional put means it exists."""
    view = body if isinstance(body, BufferChain) else BufferChain([body])
    if len(view) > store.config.max_blob_bytes:
        raise StoreRequestError("PUT", key, f"{len(view)} bytes exceeds max_blob_bytes")
    crc: int | None = None
    token = secrets.token_hex(8)
    metadata = {**(metadata or {}), WRITE_TOKEN_METADATA_KEY: token}
    if store.config.checksum_algorithm != "none":
        crc = await crc32_of(view)
        metadata[CRC_METADATA_KEY] = f"{crc:08x}"
    if len(view) >= store.config.multipart_threshold_bytes:
        # One HEAD is cheap next to uploading every part only to meet a 412.
        if await store.head_async(key) is not None:
            return PutOutcome.ALREADY_EXISTS
        created = await put_multipart(store, key, view, metadata)
        outcome = PutOutcome.CREATED if created else PutOutcome.ALREADY_EXISTS
    else:
        outcome = await _put_single(store, key, view, metadata, crc)
    if outcome is PutOutcome.ALREADY_EXISTS and await _written_by(store, key, token):
        # An attempt of ours landed and its answer was lost (a reset after the
        # server stored it; aiohttp resends once on a pooled connection, the store
        # retries): the 412 met our own blob.
        store.stats.lost_answer_writes += 1
        outcome = PutOutcome.CREATED
    if outcome is PutOutcome.CREATED:
        store.stats.bytes_uploaded += len(view)
    return outcome


async def _written_by(store: UploadingStore, key: str, token: str) -> bool:
    """Whether ``key`` holds the blob of the write that carried ``token``; False when
    that cannot be told (the store failed, the object is gone): the blob was there
    either way, and only whose it was is unknown."""
    try:
        info: Any = await store.head_async(key)
    except StoreError as exc:
        logger.debug("ec-s3: cannot tell whose blob %s is: %s", key, exc.reason)
        return False
    return info is not None and info.metadata.get(WRITE_TOKEN_METADATA_KEY) == token


async def _put_single(
    store: UploadingStore, key: str, view: BufferChain, metadata: dict[str, str], crc: int | None
) -> PutOutcome:
    async def _put(t: Transport) -> PutOutcome:
        await t.put(key, view, metadata, crc)
        return PutOutcome.CREATED

    return await _conditional(store, "PUT", key, _put)


async def _conditional(
    store: UploadingStore, op: str, key: str, fn: Callable[[Transport], Coroutine[Any, Any, PutOutcome]]
) -> PutOutcome:
    try:
        return await store._call(op, key, fn)
    except StoreRequestError as exc:
        if exc.status == 412:
            return PutOutcome.ALREADY_EXISTS
        raise
